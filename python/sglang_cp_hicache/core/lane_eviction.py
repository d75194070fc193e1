"""Lane-targeted victim planning under CP shared KV, for any radix tree (imports no SGLang).

Every capacity decision under CP shared KV is per owner lane: an extend or a load needs
device pages on the lanes its pages cycle through, a backup needs host pages on the lanes
its device pages live on. :func:`plan_lane_victims` picks, in eviction order, only leaves
that free pages on a lane still short, and stops as soon as no lane is short (every short
lane covered, not a total). It plans without evicting: a parent becomes a candidate once
every child it waits for is planned, so the plan is exactly what evicting in plan order
will free. When the short lanes cannot be covered it returns None and the caller evicts
nothing.

The plan is a pure function of replicated state (tree, priorities, node ids, per-node
lane page counts, lane free counts): every rank plans the same victims, no collective.
Nodes are anything with an ``id`` (the tie-break); what a node frees, which parent it
frees and its priority are injected, so both SGLang lines' trees use this one planner.
"""

from __future__ import annotations

import heapq
from typing import (
    Any, Callable, Dict, Hashable, Iterator, List, Optional, Protocol, Sequence, Set, Tuple,
    TypeVar,
)  # fmt: skip

from sglang_cp_hicache.core.rotation import owner_of, run_lane_counts


class TreeNodeLike(Protocol):
    """What the planner reads of a node itself: a replicated, unique id."""

    id: int


Node = TypeVar("Node", bound=TreeNodeLike)

# The node's pages per owner lane in the tier being planned.
LanePages = Callable[[Any], Sequence[int]]
# The parent that becomes a leaf of the tier once ``node`` and the planned set are gone.
FreedParent = Callable[[Any, Set[Any]], Optional[Any]]
# A node's eviction key without the id tie-break (the strategy's priority).
Priority = Callable[[Any], Any]


def lane_deficit(demand: Sequence[int], free: Sequence[int]) -> List[int]:
    """Pages still missing per lane for ``demand`` given ``free`` (0 where a lane has room)."""
    return [max(0, need - have) for need, have in zip(demand, free)]


def first_page_leaders(first_pages: Sequence[Optional[Hashable]]) -> List[Optional[int]]:
    """For each request of one extend batch, the earliest earlier request whose key starts
    with the same first page (None for the first of its page, or without a full page).

    Two requests of one batch whose keys share a first page land on one tree path: the
    later insert is refused unless both chains have one rotation base (a cached path's
    page owners are one cyclic run)."""
    first_seen: Dict[Hashable, int] = {}
    leaders: List[Optional[int]] = []
    for index, page in enumerate(first_pages):
        leader = None if page is None else first_seen.get(page)
        if page is not None and leader is None:
            first_seen[page] = index
        leaders.append(leader)
    return leaders


def base_overlaps(chain_starts: Sequence[int], lanes: int) -> List[int]:
    """Per lane, how much a chain based there piles onto the chains already started
    (``chain_starts``: chains per base lane).

    A chain's requests each put ``n // lanes`` pages on every lane and one more on the
    first ``n % lanes`` lanes from its base, so a chain based on ``b`` weighs
    ``lanes - 1 - k`` on lane ``b + k`` (the remainder taken uniform). A lane's overlap is
    the product of that ramp from the lane with the started chains' ramps: 0 everywhere
    when no chain was started, least where a new chain's heavy lanes meet the others' light
    ones."""
    load = [0] * lanes
    for base, count in enumerate(chain_starts):
        if count:
            for k in range(lanes):
                load[owner_of(base, k, lanes)] += count * (lanes - 1 - k)
    return [
        sum(load[owner_of(lane, k, lanes)] * (lanes - 1 - k) for k in range(lanes))
        for lane in range(lanes)
    ]


def new_chain_base(
    free: Sequence[int],
    pages: int,
    lanes: int,
    *,
    chain_starts: Optional[Sequence[int]] = None,
    fit_first: bool = True,
    first_page: int = 0,
) -> int:
    """The rotation base of a new chain drawing ``pages`` position-pages from
    ``first_page`` on, given ``free`` pages per lane: upstream's lane (the freest, ties to
    the lowest) unless ``fit_first`` finds lanes from which the draws fit, then among
    those the least :func:`base_overlaps` with ``chain_starts`` (none: 0), then the
    freest, then the lowest. One rule for every new chain: an extend's and an L3
    prefetch's from the root."""
    base = min(range(lanes), key=lambda lane: (-free[lane], lane))
    if not fit_first:
        return base
    fitting = [
        lane
        for lane in range(lanes)
        if not any(lane_deficit(run_lane_counts(owner_of(lane, first_page, lanes), pages, lanes), free))
    ]
    if not fitting:
        return base
    overlap = [0] * lanes if chain_starts is None else base_overlaps(chain_starts, lanes)
    return min(fitting, key=lambda lane: (overlap[lane], -free[lane], lane))


def extend_lane_demand(
    free: Sequence[int],
    bases: Sequence[Optional[int]],
    prefix_lens: Sequence[int],
    seq_lens: Sequence[int],
    lanes: int,
    page_size: int,
    *,
    fit_first: bool = False,
    leaders: Optional[Sequence[Optional[int]]] = None,
    chain_starts: Optional[Sequence[int]] = None,
) -> Tuple[List[int], List[int]]:
    """Pages per lane one extend batch draws, request by request in batch order, and each
    request's rotation base.

    Request ``i`` takes position-pages ``[prefix_i / page, ceil(seq_i / page))`` of its
    chain, position-page ``P`` on lane ``(b_i + P) % lanes``. A new chain (``b_i`` None)
    starts on the lane with the most free pages left after the earlier requests' draws,
    ties to the lowest lane (SGLang 0.5.23's ``PageInterleavePoolAllocator.alloc_extend``
    rule). With ``fit_first`` the new chain starts on a lane from which its draws fit what
    is left, and on upstream's lane when none fits: a chain the free lanes can hold at
    some rotation is never made room for. Among the lanes that fit, the freest; with
    ``chain_starts`` (chains started per base lane before the batch, this batch's new
    chains added as they resolve) first the least :func:`base_overlaps`: every request of
    a chain lays its extra pages on the lanes right after the chain's base, so chains
    based on a few lanes give those lanes more to back up, store and send. A new chain
    with a ``leaders`` entry (an earlier request of the batch, :func:`first_page_leaders`)
    takes that request's base instead, so their inserts share one rotation run.
    ``free``: pages per lane before the batch. Prefixes are page-aligned.
    """
    left = list(free)
    demand = [0] * lanes
    starts = None if chain_starts is None else list(chain_starts)
    resolved: List[int] = []
    for index, (base, prefix_len, seq_len) in enumerate(zip(bases, prefix_lens, seq_lens)):
        first_page = prefix_len // page_size
        new_pages = -(-seq_len // page_size) - first_page
        if base is None and leaders is not None and leaders[index] is not None:
            base = resolved[leaders[index]]
        if base is None:
            base = new_chain_base(
                left, new_pages, lanes, chain_starts=starts, fit_first=fit_first,
                first_page=first_page,
            )  # fmt: skip
            if starts is not None:
                starts[base] += 1
        counts = run_lane_counts(owner_of(base, first_page, lanes), new_pages, lanes)
        for lane in range(lanes):
            left[lane] -= counts[lane]
            demand[lane] += counts[lane]
        resolved.append(base)
    return demand, resolved


def plan_lane_victims(
    candidates: Iterator[Node],
    deficit: Sequence[int],
    lane_pages: LanePages,
    freed_parent: FreedParent,
    priority: Priority,
    *,
    parent_of: Optional[Callable[[Any], Optional[Any]]] = None,
) -> Optional[List[Node]]:
    """Victims, in eviction order, that together free ``deficit`` pages per lane.

    ``candidates``: the tier's evictable leaves in (priority, node id) order (e.g. a leaf
    set's ``victims()`` iterator, which the caller closes after evicting the plan, so
    planned leaves never go back on the heap). A candidate that frees nothing on a lane
    still short is not planned for itself. Lane counts are Python ints: a handful of lanes,
    where NumPy's cost per call would dominate.

    ``parent_of`` (the node's parent in the tree) also lets pages be reached through an
    ancestor: a candidate that frees nothing on a short lane is planned as an enabler in
    its (priority, id) turn, so that its parent becomes a candidate in the parent's own turn
    once every child is planned, as a plain LRU walk reaches it; the enablers whose parent
    the final plan does not evict are dropped again. So an old ancestor holding a short
    lane's pages is evicted before a younger leaf on that lane, and only the leaves needed
    to free it go with it. Without ``parent_of`` such a candidate is skipped, and a deficit
    only inner nodes hold is uncoverable (the 0.5.12 line's rule).
    """
    need = list(deficit)
    planned: List[Node] = []
    planned_set: Set[Node] = set()
    for_itself: Set[Node] = set()
    freed_parents: List[Tuple[Any, int, Node]] = []
    head = next(candidates, None)
    # Plain loops and max() rather than generator expressions: this runs once per
    # candidate on the scheduler thread, and each generator expression costs a new frame.
    while max(need) > 0:
        if freed_parents and (head is None or freed_parents[0][:2] < (priority(head), head.id)):
            node = heapq.heappop(freed_parents)[2]
        elif head is not None:
            node, head = head, next(candidates, None)
        else:
            return None
        pages = lane_pages(node)
        for lane_need, lane_pages_freed in zip(need, pages):
            if lane_pages_freed and lane_need > 0:
                for_itself.add(node)
                break
        else:
            if parent_of is None:
                continue  # frees nothing on a short lane
        planned.append(node)
        planned_set.add(node)
        need = [n - p for n, p in zip(need, pages)]
        parent = freed_parent(node, planned_set)
        if parent is not None:
            heapq.heappush(freed_parents, (priority(parent), parent.id, parent))
    if len(for_itself) == len(planned):
        return planned
    # A parent is planned after all its children: walking the plan backwards, a node's
    # parent is settled before the node.
    kept = set(for_itself)
    for node in reversed(planned):
        if node not in kept and parent_of(node) in kept:
            kept.add(node)
    return [node for node in planned if node in kept]


__all__ = [
    "FreedParent",
    "LanePages",
    "Priority",
    "TreeNodeLike",
    "extend_lane_demand",
    "first_page_leaders",
    "lane_deficit",
    "plan_lane_victims",
]
