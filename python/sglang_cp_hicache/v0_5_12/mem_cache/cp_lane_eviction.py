"""Lane-targeted victim planning for CP HiCache (device and host tiers alike).

Every capacity decision under CP shared KV is per owner lane: a load needs device pages
on the lanes its write-time owners name, a backup needs host pages on the lanes its
device pages live on. :func:`plan_lane_victims` picks, in eviction order, only leaves that
free pages on a lane still short, and stops as soon as no lane is short. It plans without
evicting: a parent becomes a candidate once every child it waits for is planned, so the
plan is exactly what evicting in plan order will free. When the short lanes cannot be
covered it returns None and the caller evicts nothing.

The plan is a pure function of replicated state (tree, priorities, node ids, per-node
lane page counts, lane free counts): every rank plans the same victims, no collective.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set, Tuple

from sglang.srt.mem_cache.radix_cache import TreeNode

# The node's pages per owner lane in the tier being planned.
LanePages = Callable[[TreeNode], Sequence[int]]
# The parent that becomes a leaf of the tier once ``node`` and the planned set are gone.
FreedParent = Callable[[TreeNode, Set[TreeNode]], Optional[TreeNode]]
# A node's eviction key without the id tie-break (the strategy's priority).
Priority = Callable[[TreeNode], Any]


def plan_lane_victims(
    candidates: Iterator[TreeNode],
    deficit: List[int],
    lane_pages: LanePages,
    freed_parent: FreedParent,
    priority: Priority,
) -> Optional[List[TreeNode]]:
    """Victims, in eviction order, that together free ``deficit`` pages per lane.

    ``candidates``: the tier's evictable leaves in (priority, node id) order (a leaf set's
    ``victims()`` iterator, which the caller closes after evicting the plan, so planned
    leaves never go back on the heap). A candidate that frees nothing on a lane still short
    is never planned. Lane counts are Python ints: a handful of lanes, where NumPy's cost
    per call would dominate.
    """
    need = list(deficit)
    planned: List[TreeNode] = []
    planned_set: Set[TreeNode] = set()
    freed_parents: List[Tuple[Any, int, TreeNode]] = []
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
                break
        else:
            continue  # frees nothing on a short lane
        planned.append(node)
        planned_set.add(node)
        need = [n - p for n, p in zip(need, pages)]
        parent = freed_parent(node, planned_set)
        if parent is not None:
            heapq.heappush(freed_parents, (priority(parent), parent.id, parent))
    return planned
