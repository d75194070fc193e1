"""Host-side state of CP HiCache: logical host pages backed by per-rank physical shards.

The radix tree stays logical: a backed-up node's ``host_value`` holds *logical host locs*,
allocated identically on every CP rank, so every upstream length, split, hit and threshold
computation on ``host_value`` is a logical one and ranks never diverge. Each logical host
page remembers the owner lane of the device page it was written from; only that owner
stores it, in a physical page of its own host pool. :class:`CpHostPageTable` is the single
place that maps logical host locs to physical host slots.

Because host pools are per rank and equal-sized, every rank can compute every lane's host
usage from the replicated owner table, so admission (does each lane have room?) and
eviction progress (has each short lane regained enough pages?) are decided identically on
all ranks without a collective.

With an MTP draft, one logical host page holds the target's *and* the draft's KV of its
tokens (the same physical slot in both host pools). The table records, per page, which
payloads the write that filled it carried (:data:`PAYLOAD_TARGET`, :data:`PAYLOAD_DRAFT`);
every read of a page (load plan, load, split metadata, free) fails fast, naming the node
and rank, unless it carries every payload the cache keeps, so a target-only page can never
become a hit.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Deque, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch

from sglang_cp_hicache.core.cp_shared_kv_layout import (
    CpSharedKVLayout,
    host_int64,
    page_offsets,
    page_token_locs,
)


class CpHiCacheMetadataError(RuntimeError):
    """CP HiCache bookkeeping is inconsistent; the message names the node and rank."""


# The owned host locs of a plan whose pages this rank owns none of (read only, shared).
_NO_HOST_LOCS = np.empty(0, dtype=np.int64)
_NO_HOST_LOCS.flags.writeable = False

# What a logical host page holds (bit mask): the target's KV, and the MTP draft's.
PAYLOAD_TARGET = 1
PAYLOAD_DRAFT = 2
_PAYLOAD_NAMES = {PAYLOAD_TARGET: "target", PAYLOAD_DRAFT: "draft"}


def payload_name(payload: int) -> str:
    names = [name for bit, name in _PAYLOAD_NAMES.items() if payload & bit]
    return " + ".join(names) if names else "nothing"


# The run and plan records below are plain (not frozen) dataclasses: one or two are built
# per load, backup or host free, where a frozen one's per-field setattr costs more than
# the NumPy work on a one-page node. Nothing writes their fields after construction.
@dataclass
class PageRun:
    """The pages of a run of locs (host int64) that lists each page's tokens contiguously.

    ``pages`` are in run order; ``page_of_loc`` is each loc's index into ``pages``, or
    ``None`` when the run is whole pages with in-page offsets in order (the usual radix
    value), which :meth:`of` recognises first because that is the common, cheap case.
    """

    locs: np.ndarray
    pages: np.ndarray
    page_of_loc: Optional[np.ndarray]
    page_size: int

    @classmethod
    def of(cls, locs: np.ndarray, page_size: int) -> "PageRun":
        pages = locs[::page_size] // page_size
        if len(locs) == len(pages) * page_size:
            whole_pages = pages[:, None] * page_size + page_offsets(page_size)
            if (locs.reshape(whole_pages.shape) == whole_pages).all():
                return cls(locs, pages, None, page_size)
        token_pages = locs // page_size
        first_of_page = np.empty(len(token_pages), dtype=bool)
        first_of_page[:1] = True
        np.not_equal(token_pages[1:], token_pages[:-1], out=first_of_page[1:])
        return cls(locs, token_pages[first_of_page], np.cumsum(first_of_page) - 1, page_size)

    def split(self, split_len: int) -> Tuple["PageRun", "PageRun"]:
        """The runs of ``locs[:split_len]`` and ``locs[split_len:]``."""
        return (
            PageRun.of(self.locs[:split_len], self.page_size),
            PageRun.of(self.locs[split_len:], self.page_size),
        )

    def relocate(self, new_pages: np.ndarray) -> np.ndarray:
        """Each loc moved to the same in-page offset of the matching page of ``new_pages``
        (one per page of the run): a padded tail page is moved whole but never exposed."""
        if self.page_of_loc is None:
            return page_token_locs(new_pages, self.page_size)
        return new_pages[self.page_of_loc] * self.page_size + self.locs % self.page_size


@dataclass
class HostWritePlan:
    """One logical backup: the node's device pages, the owner lane of each and each lane's
    page need. Replicated: every rank computes the same plan from the same node."""

    device_run: PageRun
    page_owners: np.ndarray
    lane_pages: List[int]


@dataclass
class HostLoadPlan:
    """One logical load: the node's logical host pages, their write-time owner lanes and
    each lane's device page need, replicated like :class:`HostWritePlan`; and this rank's
    physical host locs of the pages it owns (``owned_host_locs``: whole pages in page
    order, empty when it owns none), which stay fixed while the pages are allocated, so a
    load reads them from the plan instead of the table."""

    host_run: PageRun
    page_owners: np.ndarray
    lane_pages: List[int]
    owned_host_locs: np.ndarray

    @property
    def parts(self) -> Tuple["HostLoadPlan"]:
        return (self,)

    def device_locs(self, device_pages: np.ndarray) -> np.ndarray:
        """The loaded tokens' new logical device locs, ``device_pages`` holding the pages."""
        return self.host_run.relocate(device_pages)


class JoinedHostLoadPlan:
    """Consecutive nodes loaded together: their own plans (``parts``, in load order) and
    the pages each lane needs for all of them.

    Nothing is concatenated: the controller checks and prepares the lanes once for the
    total, then allocates part by part (popping each lane part after part takes the pages
    one joined allocation would), and each loaded node keeps its part's new locs. On a
    scheduler thread between tree walks every NumPy call is a cold one.
    """

    def __init__(self, plans: Sequence[HostLoadPlan]) -> None:
        self.parts = tuple(plans)
        self.lane_pages = [sum(counts) for counts in zip(*(plan.lane_pages for plan in plans))]


LoadPlan = Union[HostLoadPlan, JoinedHostLoadPlan]


@dataclass
class CpHiCacheNodeMetadata:
    """What one rank holds on host for one radix node.

    ``owned_positions`` are node-local token positions this rank stores (sorted);
    ``host_indices`` the physical host slots holding them, in the same order;
    ``page_owners`` the owner lane of each of the node's pages (identical on all ranks).
    All tensors are CPU int64. ``logical_len`` counts valid tokens; a trailing partial
    page is still one owner page.
    """

    logical_len: int
    owned_positions: torch.Tensor
    host_indices: torch.Tensor
    page_owners: torch.Tensor
    page_size: int
    node_id: int = -1
    cp_rank: int = 0

    def __post_init__(self) -> None:
        def fail(reason: str) -> None:
            raise CpHiCacheMetadataError(
                f"CP HiCache metadata of node {self.node_id} on CP rank {self.cp_rank}: {reason}"
            )

        for name in ("owned_positions", "host_indices", "page_owners"):
            tensor = getattr(self, name)
            if tensor.device.type != "cpu" or tensor.dtype != torch.int64:
                fail(f"{name} must be a CPU int64 tensor, got {tensor.dtype} on {tensor.device}")
        if self.page_size < 1 or self.logical_len < 0:
            fail(f"page_size={self.page_size}, logical_len={self.logical_len}")
        if len(self.owned_positions) != len(self.host_indices):
            fail(
                f"{len(self.owned_positions)} owned positions but "
                f"{len(self.host_indices)} host indices"
            )
        expected_pages = -(-self.logical_len // self.page_size)
        if len(self.page_owners) != expected_pages:
            fail(f"{len(self.page_owners)} page owners for {expected_pages} pages")
        if len(self.owned_positions):
            if bool((self.owned_positions[1:] <= self.owned_positions[:-1]).any()):
                fail("owned_positions must be strictly increasing")
            if int(self.owned_positions[0]) < 0 or int(self.owned_positions[-1]) >= self.logical_len:
                fail(f"owned_positions out of range [0, {self.logical_len})")
            owner_of_position = self.page_owners[self.owned_positions // self.page_size]
            if bool((owner_of_position != self.cp_rank).any()):
                fail("an owned position lies in a page owned by another rank")

    @property
    def owned_len(self) -> int:
        return len(self.owned_positions)

    def split(self, split_len: int) -> Tuple["CpHiCacheNodeMetadata", "CpHiCacheNodeMetadata"]:
        """Split at a logical offset by page, with position masks (never by slicing).

        A split inside a page would leave one physical page shared by two nodes, so
        ``split_len`` must be a page boundary (or the node's end).
        """
        if not 0 <= split_len <= self.logical_len:
            raise CpHiCacheMetadataError(
                f"node {self.node_id} on CP rank {self.cp_rank}: split_len {split_len} "
                f"outside [0, {self.logical_len}]"
            )
        if split_len % self.page_size and split_len != self.logical_len:
            raise CpHiCacheMetadataError(
                f"node {self.node_id} on CP rank {self.cp_rank}: split_len {split_len} is "
                f"inside a page (page_size {self.page_size})"
            )
        parent_mask = self.owned_positions < split_len
        split_page = -(-split_len // self.page_size)
        common = dict(page_size=self.page_size, node_id=self.node_id, cp_rank=self.cp_rank)
        parent = CpHiCacheNodeMetadata(
            logical_len=split_len,
            owned_positions=self.owned_positions[parent_mask],
            host_indices=self.host_indices[parent_mask],
            page_owners=self.page_owners[:split_page],
            **common,
        )
        child = CpHiCacheNodeMetadata(
            logical_len=self.logical_len - split_len,
            owned_positions=self.owned_positions[~parent_mask] - split_len,
            host_indices=self.host_indices[~parent_mask],
            page_owners=self.page_owners[split_page:],
            **common,
        )
        return parent, child


class CpHostPageTable:
    """The host tier's translator: logical host pages of one CP rank, with the owner lane
    and physical page of each.

    Replicated state (identical on every rank): the free list of logical host pages, the
    owner of each used page, the payloads each used page holds, and per-lane usage.
    Per-rank state: the physical host page of the pages this rank owns. Invariants:
    ``lane_used_pages[cp_rank]`` equals the pages this rank's physical host pool has handed
    out for CP HiCache; every used page holds ``payload`` (all the cache keeps on host).
    """

    def __init__(
        self, layout: CpSharedKVLayout, physical_host_pages: int, payload: int = PAYLOAD_TARGET
    ) -> None:
        self.layout = layout
        self.page_size = layout.page_size
        self.physical_host_pages = physical_host_pages
        self.num_logical_pages = physical_host_pages * layout.cp_size
        self.payload = payload
        self.clear()

    # ------------------------------------------------------------------ state
    def clear(self) -> None:
        self._free_logical_pages: Deque[int] = deque(range(self.num_logical_pages))
        self._page_owner = np.full(self.num_logical_pages, -1, dtype=np.int64)
        self._physical_page = np.full(self.num_logical_pages, -1, dtype=np.int64)
        self._page_payload = np.zeros(self.num_logical_pages, dtype=np.uint8)
        self._lane_used_pages = [0] * self.layout.cp_size

    def lane_used_pages(self) -> List[int]:
        return list(self._lane_used_pages)

    def lane_free_pages(self) -> List[int]:
        return [self.physical_host_pages - used for used in self._lane_used_pages]

    def used_logical_tokens(self) -> int:
        return (self.num_logical_pages - len(self._free_logical_pages)) * self.page_size

    def lane_fits(self, lane_pages: List[int]) -> bool:
        """Whether every lane has room for ``lane_pages`` (:meth:`lane_deficit` all 0)."""
        free = self.physical_host_pages
        return all(need <= free - used for need, used in zip(lane_pages, self._lane_used_pages))

    def lane_deficit(self, lane_pages: List[int]) -> List[int]:
        """Host pages each lane lacks to admit ``lane_pages`` (all zero: admissible)."""
        return [
            max(need - (self.physical_host_pages - used), 0)
            for need, used in zip(lane_pages, self._lane_used_pages)
        ]

    # ------------------------------------------------------------------ write
    def plan_write(self, run: PageRun) -> HostWritePlan:
        """The backup of a node whose logical device locs are ``run``."""
        owners = self.layout.owner_for_logical_pages(run.pages)
        lane_pages = np.bincount(owners, minlength=self.layout.cp_size).tolist()
        return HostWritePlan(run, owners, lane_pages)

    def commit_write(
        self,
        plan: HostWritePlan,
        owned_physical_host_pages: np.ndarray,
        payload: Optional[int] = None,
    ) -> np.ndarray:
        """Record a write admitted by :meth:`lane_deficit` that carries ``payload`` (by
        default all the cache keeps); return its logical host locs (valid tokens only, the
        in-page offsets of the device locs)."""
        num_pages = len(plan.page_owners)
        logical_pages = np.fromiter(
            (self._free_logical_pages.popleft() for _ in range(num_pages)), np.int64, num_pages
        )
        self._page_owner[logical_pages] = plan.page_owners
        self._page_payload[logical_pages] = self.payload if payload is None else payload
        owned = plan.page_owners == self.layout.cp_rank
        self._physical_page[logical_pages[owned]] = owned_physical_host_pages
        for lane, pages in enumerate(plan.lane_pages):
            self._lane_used_pages[lane] += pages
        return plan.device_run.relocate(logical_pages)

    # ------------------------------------------------------------------ load
    def plan_load(self, logical_host_locs: np.ndarray, node_id: int = -1) -> HostLoadPlan:
        run = PageRun.of(logical_host_locs, self.page_size)
        owners, lane_pages = self._owners(run.pages, node_id, "is not allocated")
        return self.load_plan(run, owners, lane_pages)

    def load_plan(self, run: PageRun, page_owners: np.ndarray, lane_pages: List[int]) -> HostLoadPlan:
        """The load plan of allocated logical host pages ``run`` whose owners are known,
        with this rank's physical host locs of them."""
        owned_count = lane_pages[self.layout.cp_rank]
        if not owned_count:
            return HostLoadPlan(run, page_owners, lane_pages, _NO_HOST_LOCS)
        owned_pages = run.pages
        if owned_count < len(owned_pages):
            owned_pages = owned_pages[page_owners == self.layout.cp_rank]
        physical_pages = self._physical_page[owned_pages]
        return HostLoadPlan(run, page_owners, lane_pages, page_token_locs(physical_pages, self.page_size))

    # ------------------------------------------------------------------ lookup
    def lane_pages(self, logical_host_locs: np.ndarray, node_id: int = -1) -> List[int]:
        """Pages per owner lane of a node's logical host locs (eviction planning)."""
        pages = PageRun.of(logical_host_locs, self.page_size).pages
        return self._owners(pages, node_id, "is not allocated")[1]

    def node_metadata(
        self, logical_host_locs: torch.Tensor, node_id: int = -1
    ) -> CpHiCacheNodeMetadata:
        """This rank's view of a node backed up at ``logical_host_locs``."""
        locs = host_int64(logical_host_locs)
        run = PageRun.of(locs, self.page_size)
        owners, _ = self._owners(run.pages, node_id, "is not allocated")
        page_of_loc = (
            np.arange(len(locs)) // self.page_size if run.page_of_loc is None else run.page_of_loc
        )
        owned_positions = np.flatnonzero(owners[page_of_loc] == self.layout.cp_rank)
        owned_locs = locs[owned_positions]
        host_indices = self._physical_page[owned_locs // self.page_size] * self.page_size + (
            owned_locs % self.page_size
        )
        return CpHiCacheNodeMetadata(
            logical_len=len(locs),
            owned_positions=torch.from_numpy(owned_positions.astype(np.int64)),
            host_indices=torch.from_numpy(host_indices),
            page_owners=torch.from_numpy(owners.copy()),
            page_size=self.page_size,
            node_id=node_id,
            cp_rank=self.layout.cp_rank,
        )

    # ------------------------------------------------------------------ free
    def release(self, logical_host_locs: np.ndarray, node_id: int = -1) -> Tuple[np.ndarray, List[int]]:
        """Free the pages of one or more nodes; return (owned physical host pages, pages
        freed per lane)."""
        pages = PageRun.of(logical_host_locs, self.page_size).pages
        owners, lane_freed = self._owners(pages, node_id, "is freed twice")
        owned_physical = self._physical_page[pages[owners == self.layout.cp_rank]]
        self._page_owner[pages] = -1
        self._physical_page[pages] = -1
        self._page_payload[pages] = 0
        for lane, freed in enumerate(lane_freed):
            self._lane_used_pages[lane] -= freed
        self._free_logical_pages.extend(pages.tolist())
        return owned_physical, lane_freed

    def _owners(self, pages: np.ndarray, node_id: int, problem: str) -> Tuple[np.ndarray, List[int]]:
        """Owner lane of each logical host page and the pages per lane; raises if a page
        is not allocated (owner -1) or lacks a payload (:meth:`check_payload`)."""
        owners = self._page_owner[pages]
        try:
            # bincount refuses negative entries: the free-page check costs nothing extra.
            lane_pages = np.bincount(owners, minlength=self.layout.cp_size).tolist()
        except ValueError:
            raise CpHiCacheMetadataError(
                f"node {node_id} on CP rank {self.layout.cp_rank}: logical host page "
                f"{int(pages[owners < 0][0])} {problem}"
            ) from None
        self.check_payload(pages, node_id)
        return owners, lane_pages

    def check_load_payload(self, plan: "LoadPlan", node_id: int = -1) -> None:
        """:meth:`check_payload` of a load plan's pages, not gathered when there is nothing
        to check."""
        if self.payload != PAYLOAD_TARGET:
            for part in plan.parts:
                self.check_payload(part.host_run.pages, node_id)

    def check_payload(self, pages: np.ndarray, node_id: int = -1) -> None:
        """Fail fast unless every logical host page in ``pages`` holds all the payloads
        the cache keeps (with a draft: target *and* draft KV). Replicated state, so every
        rank raises alike. Without a draft there is one payload, which every allocated page
        holds (:meth:`commit_write` sets it); the owner checks catch the pages that are not."""
        if self.payload == PAYLOAD_TARGET:
            return
        payloads = self._page_payload[pages]
        if len(payloads) and not (payloads == self.payload).all():
            index = int(np.flatnonzero(payloads != self.payload)[0])
            raise CpHiCacheMetadataError(
                f"node {node_id} on CP rank {self.layout.cp_rank}: logical host page "
                f"{int(pages[index])} holds {payload_name(int(payloads[index]))} KV, the cache "
                f"keeps {payload_name(self.payload)} KV on host (a page is host-valid only "
                "with every payload)"
            )


__all__ = [
    "CpHiCacheMetadataError",
    "CpHiCacheNodeMetadata",
    "CpHostPageTable",
    "HostLoadPlan",
    "JoinedHostLoadPlan",
    "LoadPlan",
    "HostWritePlan",
    "PAYLOAD_DRAFT",
    "PAYLOAD_TARGET",
    "PageRun",
    "payload_name",
]
