"""CP-aware HiCache controller for the NSA stack (extends ``HybridCacheController``).

The radix tree hands this controller *logical* device locs and *logical* host locs. It
moves only the pages this rank owns: logical device locs -> owned pages -> physical device
locs (through :class:`CpSharedKVLayout`) and logical host locs -> physical host slots
(through :class:`CpHostPageTable`). MLA KV and the indexer K/scale sidecar travel together,
because the upstream pool-transfer machinery derives the indexer indices from the KV ones.

Invariants kept for the replicated scheduler:

* every logical write and load yields exactly one ack on every rank, in the same order,
  also on a rank that owns nothing in the node (zero-owned ranks ack without transferring);
* admission (host room, device lanes) is decided from replicated owner-lane state, so a
  write or load fails on all ranks or on none, without a collective.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Callable, Iterator, List, NamedTuple, Optional

import numpy as np
import torch

from sglang.srt.managers.cache_controller import HiCacheAck
from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as _upstream
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    CacheOperation,
    HybridCacheController,
)

from sglang_cp_hicache.mem_cache.cp_hicache_metadata import (
    CpHiCacheMetadataError,
    CpHostPageTable,
    expand_valid_locs,
    pages_to_token_locs,
)
from sglang_cp_hicache.mem_cache.cp_shared_allocator import (
    CPSharedPagedTokenToKVPoolAllocator,
    host_int64,
)

logger = logging.getLogger(__name__)


class HostPageRun(NamedTuple):
    """Logical host pages of a run of host locs, in run order, and their owner lanes.

    ``lane_pages`` counts the pages per owner lane; ``page_of_loc`` is each loc's index
    into ``pages``, or ``None`` when the run is whole pages with in-page offsets in order
    (the usual radix value).
    """

    pages: np.ndarray
    owners: np.ndarray
    lane_pages: List[int]
    page_of_loc: Optional[np.ndarray]


# Called with the pages a load needs per owner lane; evicts device cache until they fit.
LaneEvictor = Callable[[torch.Tensor], None]


class CpHybridCacheController(HybridCacheController):
    """``HybridCacheController`` over one rank's owned shards of logical HiCache nodes."""

    def __init__(self, *args, lane_evictor: Optional[LaneEvictor] = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        allocator = self.mem_pool_device_allocator
        if not isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator):
            raise TypeError(
                "CpHybridCacheController needs CPSharedPagedTokenToKVPoolAllocator, got "
                f"{type(allocator).__name__}"
            )
        if self.mem_pool_host.page_size != self.page_size:
            raise ValueError("host and device page sizes differ")
        self.allocator: CPSharedPagedTokenToKVPoolAllocator = allocator
        self.layout = allocator.layout
        self.host_table = CpHostPageTable(self.layout, self.mem_pool_host.size // self.page_size)
        self.lane_evictor = lane_evictor
        # Per-lane host pages the last refused write lacked (host eviction target).
        self.last_host_deficit = torch.zeros(self.layout.cp_size, dtype=torch.int64)
        self.bytes_per_token = sum(
            entry.host_pool.size_per_token for entry in self.mem_pool_host.entries
        )
        self.bytes_written = 0
        self.bytes_loaded = 0
        self._no_locs = torch.empty(0, dtype=torch.int64)
        self._no_device_locs = torch.empty(0, dtype=torch.int64, device=self.device)
        # Host releases held back while batched_host_frees() is open.
        self._deferred_host_releases: Optional[List[torch.Tensor]] = None

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank

    def reset(self) -> None:
        super().reset()
        self.host_table.clear()
        self.last_host_deficit.zero_()

    # --------------------------------------------------------------- write (D2H)
    def write(
        self,
        device_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools=None,
    ) -> Optional[torch.Tensor]:
        """Back up a node given its logical device locs; return its logical host locs.

        Returns None (on every rank alike) when some owner lane's host pool lacks room;
        ``last_host_deficit`` then says how many pages each lane needs freed.
        """
        logical_device_locs = device_indices.to("cpu", torch.int64)
        plan = self.host_table.plan_write(logical_device_locs)
        deficit = self.host_table.lane_deficit(plan)
        if bool(deficit.any()):
            self.last_host_deficit = deficit
            return None

        owned = plan.page_owners == self.cp_rank
        owned_logical_pages = plan.logical_device_pages[owned]
        if len(owned_logical_pages):
            physical_device_locs = pages_to_token_locs(
                self.layout.logical_pages_to_physical(owned_logical_pages), self.page_size
            ).to(device_indices.device)
            physical_host_locs = super().write(
                physical_device_locs, priority, node_id, extra_pools
            )
            if physical_host_locs is None:
                raise CpHiCacheMetadataError(
                    f"node {node_id} on CP rank {self.cp_rank}: host pool refused "
                    f"{len(physical_device_locs)} slots although lane accounting has "
                    f"{int(self.host_table.lane_free_pages()[self.cp_rank])} free pages"
                )
            owned_physical_host_pages = physical_host_locs[:: self.page_size] // self.page_size
            self.bytes_written += len(physical_device_locs) * self.bytes_per_token
        else:
            owned_physical_host_pages = torch.empty(0, dtype=torch.int64)
            self._ack_without_transfer(node_id)

        logical_host_pages = self.host_table.commit_write(plan, owned_physical_host_pages)
        return expand_valid_locs(
            pages_to_token_locs(logical_host_pages, self.page_size),
            logical_device_locs,
            self.page_size,
        )

    def _ack_without_transfer(self, node_id: int) -> None:
        """A zero-owned rank still acks, so all ranks pop the same ack ids in order."""
        start_event = _upstream.device_module.Event()
        finish_event = _upstream.device_module.Event()
        start_event.record()
        finish_event.record()
        self.ack_write_queue.append(HiCacheAck(start_event, finish_event, [node_id]))

    # ---------------------------------------------------------------- load (H2D)
    def load(
        self,
        host_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools=None,
    ) -> Optional[torch.Tensor]:
        """Load logical host locs back; return new logical device locs (valid tokens only).

        New device pages repeat the owner pattern recorded at write time, so every rank
        finds its own pages again. On lane exhaustion the lane evictor frees exactly the
        short lanes once; if that is not enough, None (the request recomputes).

        Planned in NumPy on the host (a node holds a handful of pages, where torch's cost
        per call would dominate); each index array crosses to the device once.
        """
        logical_host_locs = host_int64(host_indices)
        run = self._host_pages_in_order(logical_host_locs, node_id)
        device_pages = self.allocator.alloc_logical_pages(run.owners, run.lane_pages)
        if device_pages is None and self.lane_evictor is not None:
            self.lane_evictor(torch.tensor(run.lane_pages, dtype=torch.int64))
            device_pages = self.allocator.alloc_logical_pages(run.owners, run.lane_pages)
        if device_pages is None:
            return None

        if run.lane_pages[self.cp_rank]:
            owned = run.owners == self.cp_rank
            physical_host_pages = self.host_table.physical_page_np[run.pages[owned]]
            physical_host_locs = torch.from_numpy(self.allocator.page_token_locs(physical_host_pages))
            # The owner lanes only hold pages of their owner: no ownership re-check needed.
            physical_device_pages = self.layout.logical_pages_to_physical(
                device_pages[owned], validate=False
            )
            physical_device_locs = self.allocator.to_device(
                self.allocator.page_token_locs(physical_device_pages)
            )
            pool_transfers = self._resolve_pool_transfers_allocation(
                extra_pools,
                alloc_host=False,
                kv_device_indices=physical_device_locs,
                kv_host_indices=physical_host_locs,
            )
            self.bytes_loaded += len(physical_host_locs) * self.bytes_per_token
        else:
            physical_host_locs = self._no_locs
            physical_device_locs = self._no_device_locs
            pool_transfers = None
        # An empty op still carries node_id, so start_loading acks it on this rank too.
        self.load_queue.append(
            CacheOperation(
                physical_host_locs,
                physical_device_locs,
                node_id,
                priority,
                pool_transfers=pool_transfers or None,
            )
        )
        # Valid tokens only: each host loc onto the same offset of its new page.
        if run.page_of_loc is None:  # whole pages in order: the new pages as they are
            device_locs = self.allocator.page_token_locs(device_pages)
        else:
            device_locs = device_pages[run.page_of_loc] * self.page_size + (
                logical_host_locs % self.page_size
            )
        return self.allocator.to_device(device_locs)

    def start_loading(self) -> int:
        if self.load_queue and all(op.host_indices.numel() == 0 for op in self.load_queue):
            return self._complete_empty_loads()
        return super().start_loading()

    def _complete_empty_loads(self) -> int:
        """Zero-owned loads: advance the producer and ack, as a real load would."""
        producer_id = self.layer_done_counter.update_producer()
        node_ids = [node_id for op in self.load_queue for node_id in op.node_ids]
        self.load_queue.clear()
        producer_event = self.layer_done_counter.events[producer_id]
        producer_event.start_event.record()
        for layer in range(self.layer_num):
            producer_event.complete(layer)
        self.ack_load_queue.append(
            HiCacheAck(producer_event.start_event, producer_event.finish_event, node_ids)
        )
        return producer_id

    # ------------------------------------------------------------------- evict
    def evict_host(self, host_indices: torch.Tensor, backup_only: bool = True) -> int:
        """Free a node's logical host pages and this rank's physical shards of them.

        Returns the logical token count, identical on all ranks.
        """
        if not backup_only:
            raise ValueError("Other eviction policies are not supported yet.")
        self.release_host(host_indices)
        return len(host_indices)

    def _host_pages_in_order(self, logical_host_locs: np.ndarray, node_id: int = -1) -> HostPageRun:
        """The logical host pages of a run of host locs, in run order, with their owners.

        NumPy on purpose: a node holds a handful of pages, and at that size NumPy's cost
        per call is a fraction of torch's on the load and host-eviction hot paths. Radix
        values list each page's tokens contiguously, so consecutive de-duplication finds
        the pages; the usual run (whole pages, offsets in order) is recognised first.
        """
        page_size = self.page_size
        page_of_loc = None
        pages = logical_host_locs[::page_size] // page_size
        whole = len(logical_host_locs) == len(pages) * page_size and bool(
            (logical_host_locs == self.allocator.page_token_locs(pages)).all()
        )
        if not whole:
            token_pages = logical_host_locs // page_size
            first_of_page = np.empty(len(token_pages), dtype=bool)
            first_of_page[:1] = True
            np.not_equal(token_pages[1:], token_pages[:-1], out=first_of_page[1:])
            pages = token_pages[first_of_page]
            page_of_loc = np.cumsum(first_of_page) - 1
        owners = self.host_table.page_owner_np[pages]
        try:
            lane_pages = self.allocator.lane_demand(owners)
        except ValueError:  # owner -1: a page no write allocated (or freed since)
            raise CpHiCacheMetadataError(
                f"node {node_id} on CP rank {self.cp_rank}: logical host page "
                f"{int(pages[owners < 0][0])} is not allocated"
            ) from None
        return HostPageRun(pages, owners, lane_pages, page_of_loc)

    def release_host(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor:
        """Free like :meth:`evict_host`; return the pages freed per lane.

        Inside :meth:`batched_host_frees` the lane counts come back at once, and the page
        table and this rank's host pool are updated when the batch closes.
        """
        if self._deferred_host_releases is None:
            return self._release_host_now(host_indices, node_id)
        run = self._host_pages_in_order(host_int64(host_indices), node_id)
        self._deferred_host_releases.append(host_indices)
        return torch.tensor(run.lane_pages, dtype=torch.int64)

    def _release_host_now(self, host_indices: torch.Tensor, node_id: int = -1) -> torch.Tensor:
        owned_physical_pages, lane_freed = self.host_table.release(host_indices, node_id)
        if len(owned_physical_pages):
            self.mem_pool_host.free(pages_to_token_locs(owned_physical_pages, self.page_size))
        return lane_freed

    @contextmanager
    def batched_host_frees(self) -> Iterator[None]:
        """Defer the ``release_host`` calls inside (each node at most once) to one release
        when the batch closes: the same page table and host free list as one release per
        node, in call order, for one table update and one O(free list) host free."""
        self._deferred_host_releases = []
        try:
            yield
        finally:
            deferred, self._deferred_host_releases = self._deferred_host_releases, None
            if deferred:
                # Not release_host: whoever counts its calls has seen each node already.
                self._release_host_now(torch.cat(deferred))

    # ----------------------------------------------------------------- metrics
    def host_usage(self) -> dict:
        """Logical tokens cached on host (all ranks) and this rank's physical slots."""
        return {
            "logical_tokens": self.host_table.used_logical_tokens(),
            "physical_slots": int(self.host_table.lane_used_pages[self.cp_rank]) * self.page_size,
            "lane_used_pages": self.host_table.lane_used_pages.tolist(),
        }
