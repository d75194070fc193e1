"""Owner-lane paged allocator for NSA prefill CP shared KV.

The allocator hands out *logical* locs (identical on every CP rank) while each rank's
physical pool (``get_kvcache()``) stores only the pages it owns (see
:class:`CpSharedKVLayout`). Free logical pages are kept in one lane per owner rank:
lane ``r`` holds the logical pages ``p`` with ``p % cp_size == r``, i.e. physical pages
``1 .. num_physical_pages`` of rank ``r`` (physical page 0 is the padding page).

Placement (never depends on ``cp_rank``, so every rank driven by the same call sequence
returns the same locs):

* new pages (``alloc_extend``, ``alloc_decode``, ``alloc``) are *balanced*
  (:func:`balanced_page_owners`): the lanes with the most free pages first, interleaved
  page by page; in ``alloc_extend`` the pages short of an even level go to the tied lanes
  that sent the fewest pages, and a fresh chain's first pages go on distinct lanes, the
  ones that sent the fewest pages first (:func:`extend_page_owners`; the pages sent are
  counted by the cache, :meth:`CPSharedPagedTokenToKVPoolAllocator.count_sent_pages`, from
  logical locs). Any lane is a correct owner of a new page: under NSA prefill CP the
  chunk's latent KV and indexer key are all-gathered before they are stored, so every
  rank holds every new token's KV at store time, in both split modes and for batches
  that are not CP-split (``docs/cp_shared_kv_layout.md``). An allocation of new pages
  therefore succeeds whenever the lanes *together* have the pages, exactly as upstream;
* ``alloc_pages_with_owners`` / ``alloc_logical_pages``: the caller's exact per-page owner
  sequence (a load-back keeps the pages on their write-time owners).

A lane never lends pages to another lane. A call that cannot be served returns ``None``
and leaves every free list unchanged; :meth:`CPSharedPagedTokenToKVPoolAllocator.lane_deficit`
says, before a call, which lanes would be short.
"""

from __future__ import annotations

import itertools
import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterator, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator

from sglang_cp_hicache.core.cp_shared_kv_layout import (
    CpSharedKVLayout,
    ceil_div,
    host_int64,
    page_token_locs,
)

logger = logging.getLogger(__name__)

IntArrayLike = Union[torch.Tensor, np.ndarray, Sequence[int]]
LaneState = Tuple[Tuple[np.ndarray, ...], Tuple[np.ndarray, ...]]


def _segment_offsets(counts: np.ndarray) -> Tuple[np.ndarray, np.ndarray]:
    """For segments of the given lengths: (segment id, index within segment) per element."""
    segment_ids = np.repeat(np.arange(len(counts)), counts)
    starts = np.cumsum(counts) - counts
    return segment_ids, np.arange(len(segment_ids)) - starts[segment_ids]


# ------------------------------------------------------------------ placement
def balanced_lane_counts(
    lane_free: Sequence[int], num_pages: int, lane_sent: Optional[Sequence[int]] = None
) -> Optional[List[int]]:
    """Pages per lane for ``num_pages`` new pages, leaving the lanes' free counts as even as
    possible (water-filling); ``None`` if the lanes together are short. The pages short of
    a level go to the tied lanes in lane order, or with ``lane_sent`` to those that sent
    the fewest pages first (then the lower lane): the lanes end as even either way."""
    if num_pages > sum(lane_free):
        return None
    # Smallest level L whose excess sum(max(a - L, 0)) fits into num_pages. With the free
    # counts sorted down, a_1 >= ... >= a_cp (a_{cp+1} = 0), the excess on [a_{k+1}, a_k] is
    # (a_1 + ... + a_k) - k L: the lowest interval holding a fitting level gives it. A
    # closed form per interval, so an extend pays O(cp log cp), not a search over levels.
    ordered = sorted(lane_free, reverse=True) + [0]
    totals = list(itertools.accumulate(ordered))
    low = 0
    for k in range(len(lane_free), 0, -1):
        level = max(ordered[k], -(-(totals[k - 1] - num_pages) // k))
        if level <= ordered[k - 1]:
            low = level
            break
    counts = [max(a - low, 0) for a in lane_free]
    leftover = num_pages - sum(counts)
    # The lanes with free >= low all keep exactly `low` pages now; leftover is less than
    # their number (level low - 1 would overshoot), and 0 when low == 0.
    lanes = range(len(lane_free))
    if lane_sent is not None and leftover:
        lanes = sorted(lanes, key=lambda lane: (lane_sent[lane], lane))
    for lane in lanes:
        if leftover == 0:
            break
        if lane_free[lane] >= low:
            counts[lane] += 1
            leftover -= 1
    return counts


def balanced_page_owners(lane_free: Sequence[int], num_pages: int) -> Optional[np.ndarray]:
    """Owner lane of each of ``num_pages`` new pages: :func:`balanced_lane_counts`, dealt
    out by :func:`_deal_round_by_round`. ``None`` if the lanes together are short."""
    counts = balanced_lane_counts(lane_free, num_pages)
    if counts is None:
        return None
    return _deal_round_by_round(counts, lane_free)


def _deal_round_by_round(counts: Sequence[int], lane_free: Sequence[int]) -> np.ndarray:
    """``counts[lane]`` pages per lane dealt out round by round (one page per lane with pages
    left, the freest lane first, ties to the lower lane), so any run of consecutive pages (a
    request, a later prefix hit of part of it) is spread over the lanes too, and a lane's
    place in a run does not depend on its number."""
    lanes, rounds = _segment_offsets(np.asarray(counts, dtype=np.int64))
    free = np.asarray(lane_free, dtype=np.int64)
    return lanes[np.lexsort((lanes, -free[lanes], rounds))].astype(np.int64)


def fresh_chain_head_lanes(
    lane_sent: Sequence[int],
    lane_free: Sequence[int],
    planned: List[int],
    kept: List[int],
    num_pages: int,
) -> List[int]:
    """Owner lanes of a fresh chain's first pages, in position order: distinct lanes, those
    that sent the fewest pages first (ties: the freest, then the lower lane).

    ``planned``: the batch's pages per lane not dealt yet (the water-fill's counts), and
    ``kept``: the free pages per lane the plan leaves; both updated in place (the heads are
    taken from ``planned``). A head lane the plan gives no page takes one
    of its free pages from a donor lane outside the heads (the most-sent first) that gives
    up one planned page; each lane gives or takes at most one, so a lane's fill moves by at
    most one page against the plan. At most ``min(num_pages, cp)`` heads, fewer when donors
    run out.
    """
    cp = len(planned)
    order = sorted(range(cp), key=lambda lane: (lane_sent[lane], -lane_free[lane], lane))
    first = order[: min(num_pages, cp)]
    if all(planned[lane] for lane in first):
        # The plan gives every least-sent lane a page: no donor, no receiver (the common
        # case, a request of at least cp pages on balanced lanes); the loop below would
        # take the same heads.
        for lane in first:
            planned[lane] -= 1
        return first

    def donors(heads: List[int]) -> List[int]:
        # Outside the heads: any planned page; a head: one beyond its own.
        return [lane for lane in reversed(order) if planned[lane] > (lane in heads)]

    heads: List[int] = []
    for lane in order:
        if len(heads) == min(num_pages, cp):
            break
        if planned[lane] == 0 and kept[lane] == 0:
            continue
        trial = heads + [lane]
        if sum(planned[h] == 0 for h in trial) <= len(donors(trial)):
            heads = trial
    receivers = [lane for lane in heads if planned[lane] == 0]
    for receiver, donor in zip(receivers, donors(heads)):
        planned[donor] -= 1
        kept[donor] += 1
        planned[receiver] += 1
        kept[receiver] -= 1
    for lane in heads:
        planned[lane] -= 1
    return heads


def extend_page_owners(
    lane_free: Sequence[int],
    lane_sent: Sequence[int],
    pages_per_request: Sequence[int],
    fresh: Sequence[bool],
) -> Optional[np.ndarray]:
    """Owner lane of each new page of an extend batch (the requests' pages in order).

    The lanes' counts are :func:`balanced_lane_counts` of the batch with the pages short of
    an even level on the tied lanes that sent the fewest pages (a lane's fill is the
    water-fill's either way; under PD every later request sharing a page sends it again
    from its owner). A fresh chain (a request with no cached prefix) starts a
    prefix that later requests re-use and, under PD, send again from the same owners (the
    lower the page, the more requests share it): its first pages go on distinct lanes, the
    ones that sent the fewest pages first (:func:`fresh_chain_head_lanes`; within the batch
    each head counts as one page sent, so two fresh chains start apart). A lane's fill moves
    by at most one page per fresh chain against the water-fill (none when the water-fill
    gives each head lane a page anyway). Every other page is dealt round by round, as
    :func:`balanced_page_owners` deals. ``None`` if the lanes together are short.
    """
    total = int(sum(pages_per_request))
    planned = balanced_lane_counts(lane_free, total, lane_sent)
    if planned is None:
        return None
    if not any(fresh):
        return _deal_round_by_round(planned, lane_free)
    sent = list(lane_sent)
    kept = [free - plan for free, plan in zip(lane_free, planned)]
    heads: List[List[int]] = []
    for num_pages, is_fresh in zip(pages_per_request, fresh):
        lanes = fresh_chain_head_lanes(sent, lane_free, planned, kept, num_pages) if is_fresh else []
        for lane in lanes:
            sent[lane] += 1
        heads.append(lanes)
    rest = _deal_round_by_round(planned, lane_free)
    owners = np.empty(total, dtype=np.int64)
    start = rest_start = 0
    for num_pages, lanes in zip(pages_per_request, heads):
        tail = num_pages - len(lanes)
        owners[start : start + len(lanes)] = lanes
        owners[start + len(lanes) : start + num_pages] = rest[rest_start : rest_start + tail]
        start += num_pages
        rest_start += tail
    return owners


@dataclass(frozen=True)
class _ExtendRows:
    """An extend batch's locs as rows: one continuation row per request that continues
    its partially filled prefix page, then one row per new page (the last one possibly
    partial). ``slots`` index ``[last_loc + 1 per request, new page bases...]``."""

    slots: np.ndarray
    tokens: np.ndarray
    batch_size: int


def _extend_rows(prefix_lens_cpu: IntArrayLike, seq_lens_cpu: IntArrayLike, page_size: int) -> _ExtendRows:
    """The row plan of upstream ``alloc_extend_naive``'s layout, on the host."""
    prefix_lens = host_int64(prefix_lens_cpu)
    seq_lens = host_int64(seq_lens_cpu)
    batch_size = len(prefix_lens)
    first_new_page = ceil_div(prefix_lens, page_size)
    num_new_pages = ceil_div(seq_lens, page_size) - first_new_page
    num_continued = np.minimum(seq_lens, first_new_page * page_size) - prefix_lens
    continues = (num_continued > 0).astype(np.int64)

    request_ids, row_in_request = _segment_offsets(continues + num_new_pages)
    is_continuation_row = row_in_request < continues[request_ids]
    page_in_request = row_in_request - continues[request_ids]
    first_page_slot = batch_size + np.cumsum(num_new_pages) - num_new_pages
    # Slots index the row bases: request i's continuation at i, new pages after the batch.
    row_slots = np.where(
        is_continuation_row, request_ids, first_page_slot[request_ids] + page_in_request
    )
    new_page_tokens = (seq_lens - prefix_lens - num_continued)[request_ids]
    row_tokens = np.where(
        is_continuation_row,
        num_continued[request_ids],
        np.minimum(new_page_tokens - page_in_request * page_size, page_size),
    )
    return _ExtendRows(row_slots, row_tokens, batch_size)


def _extend_token_locs(
    prefix_lens_cpu: torch.Tensor,
    seq_lens_cpu: torch.Tensor,
    last_loc: torch.Tensor,
    new_pages: torch.Tensor,
    page_size: int,
    extend_num_tokens: int,
) -> torch.Tensor:
    """Token locs of an extend batch, the layout of upstream ``alloc_extend_naive``.

    Per request: first the tokens continuing the partially filled prefix page
    (``last_loc + 1 + i``), then the request's new pages in order, the last one possibly
    partial. The plan is built per *row* (one continuation row or one new page) on CPU
    from the CPU lens, so the device expands rows to tokens without a host sync.
    """
    rows = _extend_rows(prefix_lens_cpu, seq_lens_cpu, page_size)
    device = new_pages.device
    bases = torch.cat((last_loc.to(device=device, dtype=torch.int64) + 1, new_pages * page_size))
    row_bases = bases[torch.from_numpy(rows.slots).to(device)]
    token_grid = (row_bases[:, None] + torch.arange(page_size, device=device)).reshape(-1)
    if bool((rows.tokens == page_size).all()):
        token_locs = token_grid
    else:
        kept = np.flatnonzero(np.arange(page_size)[None, :] < rows.tokens[:, None])
        token_locs = token_grid[torch.from_numpy(kept).to(device)]
    assert len(token_locs) == extend_num_tokens, (len(token_locs), extend_num_tokens)
    return token_locs


def extend_token_locs_host(
    prefix_lens_cpu: IntArrayLike,
    seq_lens_cpu: IntArrayLike,
    last_locs: np.ndarray,
    new_pages: np.ndarray,
    page_size: int,
) -> np.ndarray:
    """Host twin of the locs ``alloc_extend`` returns, given the same lens, each request's
    last prefix loc (-1 without a prefix) and the new pages it took (host int64); raises
    ``ValueError`` if the lens need another number of new pages."""
    rows = _extend_rows(prefix_lens_cpu, seq_lens_cpu, page_size)
    needed = int(np.count_nonzero(rows.slots >= rows.batch_size))
    if len(new_pages) != needed:
        raise ValueError(f"{len(new_pages)} new pages given, the lens need {needed}")
    bases = np.concatenate((last_locs + 1, new_pages * page_size))
    token_grid = bases[rows.slots][:, None] + np.arange(page_size)
    return token_grid[np.arange(page_size)[None, :] < rows.tokens[:, None]]


# ------------------------------------------------------------------------ lanes
class OwnerLaneFreePages:
    """Free logical pages, one lane per owner rank, kept on the host.

    Host (NumPy) lanes on purpose: calls move a handful of pages, so a device free list
    would spend its time launching a few kernels per lane per call, and the per-lane
    counts the scheduler reads on every batch would each need a read-back. Results
    cross to the device once per allocation (see the allocator's ``to_device``).

    Invariants: lane ``r`` only ever holds logical pages ``p`` with ``p % cp_size == r``
    and ``p >= cp_size`` (physical page 0 is reserved); a page is in at most one of a
    lane's ``free_pages`` / ``release_pages`` arrays; ``page_counts[r]`` is the length of
    both together. Arrays are replaced, never written in place, so :meth:`snapshot` is a
    cheap shallow copy.
    """

    def __init__(self, layout: CpSharedKVLayout, num_physical_pages: int, need_sort: bool):
        self.layout = layout
        self.cp_size = layout.cp_size
        self.num_physical_pages = num_physical_pages
        self.need_sort = need_sort
        self.free_pages: List[np.ndarray] = []
        self.release_pages: List[np.ndarray] = []
        self.page_counts: List[int] = []
        self.reset()

    def reset(self) -> None:
        physical_pages = np.arange(1, self.num_physical_pages + 1, dtype=np.int64)
        self.free_pages = [
            self.layout.owner_lane_pages(physical_pages, lane) for lane in range(self.cp_size)
        ]
        self.release_pages = [np.empty(0, dtype=np.int64) for _ in range(self.cp_size)]
        self.page_counts = [self.num_physical_pages] * self.cp_size

    def available_pages(self) -> torch.Tensor:
        """Free pages per lane (int64 CPU tensor [cp_size])."""
        return torch.tensor(self.page_counts, dtype=torch.int64)

    def total_pages(self) -> int:
        return sum(self.page_counts)

    def lane_demand(self, page_owners: np.ndarray) -> List[int]:
        """Pages per lane that ``page_owners`` asks for; raises on an owner out of range."""
        try:
            demand = np.bincount(page_owners, minlength=self.cp_size)  # raises on negatives
        except ValueError:
            demand = None
        if demand is None or len(demand) > self.cp_size:
            raise ValueError(
                f"page owners must be in [0, {self.cp_size}), got min {int(page_owners.min())} "
                f"max {int(page_owners.max())}"
            )
        return demand.tolist()

    def fits(self, demand: List[int]) -> bool:
        """Whether every lane holds the pages ``demand`` asks of it."""
        return not any(map(int.__gt__, demand, self.page_counts))

    def deficit(self, demand: List[int]) -> List[int]:
        """Pages per lane missing to serve ``demand``."""
        return [max(wanted - free, 0) for wanted, free in zip(demand, self.page_counts)]

    def take(self, page_owners: np.ndarray, demand: List[int]) -> np.ndarray:
        """Pop one page per entry from the entry's lane; pages follow the input order.

        ``demand`` is :meth:`lane_demand` of the owners, checked with :meth:`fits`.
        """
        taken = [self._pop(lane, count) for lane, count in enumerate(demand) if count]
        if len(taken) <= 1:  # one lane: already in input order
            return taken[0] if taken else np.empty(0, dtype=np.int64)
        # Grouped by lane; the stable sort of the owners says where each group goes.
        pages = np.empty(len(page_owners), dtype=np.int64)
        pages[np.argsort(page_owners, kind="stable")] = np.concatenate(taken)
        return pages

    def put(self, logical_pages: np.ndarray) -> None:
        """Return unique logical pages to their owner lanes (prepended, like upstream)."""
        lanes = self.layout.owner_for_logical_pages(logical_pages)
        pages_by_lane = logical_pages[np.argsort(lanes, kind="stable")]
        counts = np.bincount(lanes, minlength=self.cp_size).tolist()
        target = self.release_pages if self.need_sort else self.free_pages
        start = 0
        for lane, count in enumerate(counts):
            if count:
                target[lane] = np.concatenate((pages_by_lane[start : start + count], target[lane]))
                self.page_counts[lane] += count
                start += count

    def merge_short(self, demand: List[int]) -> None:
        """Merge each lane whose free list is shorter than ``demand`` asks of it (what
        :meth:`_pop` of that many pages would do first)."""
        for lane, count in enumerate(demand):
            self._merge_if_short(lane, count)

    def merge_and_sort(self) -> None:
        for lane in range(self.cp_size):
            self._merge_lane(lane)

    def snapshot(self) -> LaneState:
        return tuple(self.free_pages), tuple(self.release_pages)

    def restore(self, state: LaneState) -> None:
        free, release = state
        self.free_pages, self.release_pages = list(free), list(release)
        self.page_counts = [len(f) + len(r) for f, r in zip(free, release)]

    def _pop(self, lane: int, count: int) -> np.ndarray:
        self._merge_if_short(lane, count)
        free = self.free_pages[lane]
        self.free_pages[lane] = free[count:]
        self.page_counts[lane] -= count
        return free[:count]

    def _merge_if_short(self, lane: int, count: int) -> None:
        if count > len(self.free_pages[lane]):
            self._merge_lane(lane)

    def _merge_lane(self, lane: int) -> None:
        if len(self.release_pages[lane]) == 0:
            return
        self.free_pages[lane] = np.sort(
            np.concatenate((self.free_pages[lane], self.release_pages[lane]))
        )
        self.release_pages[lane] = self.release_pages[lane][:0]


# -------------------------------------------------------------------- allocator
class CPSharedPagedTokenToKVPoolAllocator(PagedTokenToKVPoolAllocator):
    """Paged allocator over the logical loc space of a CP group with owner lanes.

    ``size`` (logical tokens) is ``physical_size * cp_size``; ``available_size()`` is the
    logical free token count summed over lanes, matching upstream semantics so the
    scheduler's ``available + evictable == max_total_num_tokens`` check holds. Upstream's
    single ``free_pages``/``release_pages`` lists are ``None``: state lives in ``lanes``.
    """

    def __init__(
        self,
        physical_size: int,
        page_size: int,
        dtype: torch.dtype,
        device: Union[str, torch.device],
        kvcache,
        need_sort: bool,
        cp_size: int,
        cp_rank: int,
    ):
        self.layout = CpSharedKVLayout(cp_size=cp_size, cp_rank=cp_rank, page_size=page_size)
        self.cp_size = cp_size
        self.cp_rank = cp_rank
        self.physical_size = physical_size
        self.lanes = OwnerLaneFreePages(self.layout, physical_size // page_size, need_sort)
        self._on_host = torch.device(device).type == "cpu"
        self._new_page_log: Optional[List[np.ndarray]] = None  # open in recording_new_pages
        self.sent_pages: List[int] = [0] * cp_size  # per lane; reset by clear()
        # Upstream __init__ calls clear(), which resets the lanes built above.
        super().__init__(physical_size * cp_size, page_size, dtype, device, kvcache, need_sort)

    # ------------------------------------------------------------ accounting
    def available_size(self) -> int:
        return self.lanes.total_pages() * self.page_size

    def lane_available_pages(self) -> torch.Tensor:
        """Free pages per owner lane (int64 CPU tensor [cp_size])."""
        return self.lanes.available_pages()

    def lane_free_pages(self) -> List[int]:
        """Free pages per owner lane (host list; the planners' form)."""
        return list(self.lanes.page_counts)

    def lane_demand(self, page_owners: np.ndarray) -> List[int]:
        """Pages per owner lane that ``page_owners`` (host int64) asks for; raises
        ``ValueError`` on an owner outside ``[0, cp_size)``."""
        return self.lanes.lane_demand(page_owners)

    def lane_fits(self, lane_pages: List[int]) -> bool:
        """Whether every lane has ``lane_pages`` free (Python ints): ``lane_deficit`` all 0."""
        return self.lanes.fits(lane_pages)

    def lane_deficit(self, lane_pages: Sequence[int]) -> List[int]:
        """Pages each lane lacks to serve ``lane_pages`` pages per lane (all 0: it fits)."""
        return self.lanes.deficit(list(lane_pages))

    def count_sent_pages(self, logical_pages: np.ndarray) -> None:
        """Count ``logical_pages`` (host int64) as sent by their owner lanes: a finished
        request's prompt, which a PD prefill sends from each page's owner. Logical, so the
        counts are the same on every rank; :func:`extend_page_owners` reads them."""
        owners = self.layout.owner_for_logical_pages(logical_pages)
        sent = np.bincount(owners, minlength=self.cp_size) + np.asarray(self.sent_pages)
        self.sent_pages = sent.tolist()

    # ------------------------------------------------------------ allocation
    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        """Page-aligned locs of ``need_size // page_size`` balanced new pages."""
        pages = self._take_new_pages(need_size // self.page_size)
        if pages is None:
            return None
        return self.to_device(page_token_locs(pages, self.page_size))

    def alloc_pages_with_owners(self, page_owners: IntArrayLike) -> Optional[torch.Tensor]:
        """Page-contiguous locs (``len(page_owners) * page_size``) whose page ``i`` is
        owned by ``page_owners[i]``; ``None`` if any lane is short."""
        pages = self.alloc_logical_pages(host_int64(page_owners))
        if pages is None:
            return None
        return self.to_device(page_token_locs(pages, self.page_size))

    def alloc_logical_pages(
        self, page_owners: np.ndarray, lane_pages: Optional[List[int]] = None
    ) -> Optional[np.ndarray]:
        """Host form of :meth:`alloc_pages_with_owners`: the logical pages themselves, for
        callers that derive several index arrays from them before one device copy.

        ``lane_pages``: the owners' per-lane page counts, if the caller has them already.
        """
        if lane_pages is None:
            lane_pages = self.lanes.lane_demand(page_owners)
        if not self.lanes.fits(lane_pages):
            return None
        return self.take_logical_pages(page_owners, lane_pages)

    def prepare_takes(self, lane_pages: List[int]) -> None:
        """Before several :meth:`take_logical_pages` that together ask ``lane_pages`` (which
        fit): merge the released pages of each lane whose free list is short of its total,
        as one take of the total would first. The takes then give that take's pages."""
        self.lanes.merge_short(lane_pages)

    def take_logical_pages(self, page_owners: np.ndarray, lane_pages: List[int]) -> np.ndarray:
        """:meth:`alloc_logical_pages` without its room check, for a caller that checked
        the lanes once (:meth:`lane_fits`) for several takes."""
        return self.lanes.take(page_owners, lane_pages)

    def alloc_extend(
        self,
        prefix_lens: torch.Tensor,
        prefix_lens_cpu: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
        extend_num_tokens: int,
        num_new_pages: Optional[int] = None,
    ) -> Optional[torch.Tensor]:
        """Upstream ``alloc_extend`` layout with new pages placed by
        :func:`extend_page_owners` (a request with prefix 0 starts a fresh chain).

        Only the ``*_cpu`` lens are read (``prefix_lens``/``seq_lens`` are kept for the
        upstream signature); ``num_new_pages``, when given, must match them.
        """
        prefix_lens_host = host_int64(prefix_lens_cpu)
        new_pages_per_request = ceil_div(host_int64(seq_lens_cpu), self.page_size) - ceil_div(
            prefix_lens_host, self.page_size
        )
        needed = int(new_pages_per_request.sum())
        if num_new_pages is not None and num_new_pages != needed:
            raise ValueError(f"num_new_pages={num_new_pages} but the lens need {needed} new pages")
        new_pages = self._take_pages(
            extend_page_owners(
                self.lanes.page_counts,
                self.sent_pages,
                new_pages_per_request.tolist(),
                (prefix_lens_host == 0).tolist(),
            ),
            needed,
        )
        if new_pages is None:
            return None
        return _extend_token_locs(
            prefix_lens_cpu,
            seq_lens_cpu,
            last_loc,
            self.to_device(new_pages),
            self.page_size,
            extend_num_tokens,
        )

    def alloc_decode(
        self,
        seq_lens: torch.Tensor,
        seq_lens_cpu: torch.Tensor,
        last_loc: torch.Tensor,
    ) -> Optional[torch.Tensor]:
        """One loc per request: ``last_loc + 1``, or the first loc of a balanced new page
        when the token starts a page."""
        starts_page_cpu = (seq_lens_cpu.to(torch.int64) - 1) % self.page_size == 0
        new_pages = self._take_new_pages(int(starts_page_cpu.sum()))
        if new_pages is None:
            return None
        new_pages = self.to_device(new_pages)
        token_locs = last_loc.to(torch.int64) + 1
        rows = torch.nonzero(starts_page_cpu, as_tuple=True)[0].to(token_locs.device)
        token_locs[rows] = new_pages * self.page_size
        return token_locs

    # --------------------------------------------------------------- release
    def free(self, free_index: torch.Tensor) -> None:
        """Return the pages of logical locs ``free_index`` to their owner lanes."""
        if free_index.numel() == 0:
            return
        if not self.is_not_in_free_group:
            self.free_group.append(free_index)
            return
        # Unique on the index's own device first: the host then gets pages, not tokens
        # (the lane counts need the host anyway, as upstream's unique does).
        self.lanes.put(torch.unique(free_index // self.page_size).cpu().numpy())

    def merge_and_sort_free(self) -> None:
        self.lanes.merge_and_sort()

    def clear(self) -> None:
        self.lanes.reset()
        self.sent_pages = [0] * self.cp_size
        self.is_not_in_free_group = True
        self.free_group = []

    def backup_state(self) -> LaneState:
        return self.lanes.snapshot()

    def restore_state(self, state: LaneState) -> None:
        self.lanes.restore(state)

    # ------------------------------------------------------- index helpers
    def to_device(self, host_locs: np.ndarray) -> torch.Tensor:
        """One host -> device copy of an index array this allocator produced.

        Non-blocking: the source is pageable, so the driver stages it before returning and
        the array may be dropped at once; the scheduler stream is not synchronised.
        """
        tensor = torch.from_numpy(host_locs)
        return tensor if self._on_host else tensor.to(self.device, non_blocking=True)

    @contextmanager
    def recording_new_pages(self) -> Iterator[List[np.ndarray]]:
        """The new pages (host int64, in order) that ``alloc``, ``alloc_extend`` and
        ``alloc_decode`` take inside: the host form of the locs they return, which the
        scheduler path mirrors (``ReqToTokenHostMirror``) instead of reading them back."""
        if self._new_page_log is not None:
            raise RuntimeError("recording_new_pages does not nest")
        self._new_page_log = []
        try:
            yield self._new_page_log
        finally:
            self._new_page_log = None

    # --------------------------------------------------------------- helpers
    def _take_new_pages(self, num_pages: int) -> Optional[np.ndarray]:
        """``num_pages`` balanced new pages, or ``None`` (lanes untouched) if the lanes
        together are short."""
        return self._take_pages(balanced_page_owners(self.lanes.page_counts, num_pages), num_pages)

    def _take_pages(self, page_owners: Optional[np.ndarray], num_pages: int) -> Optional[np.ndarray]:
        """New pages of the placement ``page_owners`` (``None``: the lanes together are
        short of ``num_pages``; nothing is taken)."""
        if page_owners is None:
            logger.debug("CP shared KV allocator short of %d pages", num_pages)
            return None
        pages = self.lanes.take(page_owners, self.lanes.lane_demand(page_owners))
        if self._new_page_log is not None:
            self._new_page_log.append(pages)
        return pages
