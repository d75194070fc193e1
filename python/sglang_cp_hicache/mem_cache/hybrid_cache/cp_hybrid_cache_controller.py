"""CP-aware HiCache controller for the NSA stack (extends ``HybridCacheController``).

Mechanism only: the radix cache plans (through :class:`CpHostPageTable`, the host tier's
translator), makes room, and hands this controller a plan to execute. The controller
never calls back into the cache and never evicts.

It moves only the pages this rank owns: logical device pages -> physical device locs
(:class:`CpSharedKVLayout`) and logical host pages -> physical host slots (the table).
MLA KV and the indexer K/scale sidecar travel together, because the upstream
pool-transfer machinery derives the indexer indices from the KV ones.

Invariants kept for the replicated scheduler:

* every logical write and load yields exactly one ack on every rank, in the same order,
  also on a rank that owns nothing in the node (zero-owned ranks ack without transferring,
  so no transfer op ever sees empty indices);
* capacity (host room per lane, device pages per lane) is decided from replicated
  owner-lane state, so a write or load is refused on all ranks or on none, without a
  collective; after the planner made room, execution cannot fail for capacity.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator, List, Optional

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
    HostLoadPlan,
    HostWritePlan,
    PageRun,
)
from sglang_cp_hicache.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import host_int64, page_token_locs

logger = logging.getLogger(__name__)


class CpHybridCacheController(HybridCacheController):
    """``HybridCacheController`` over one rank's owned shards of logical HiCache nodes."""

    def __init__(self, *args, **kwargs) -> None:
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
        self._no_locs = torch.empty(0, dtype=torch.int64)
        self._no_device_locs = torch.empty(0, dtype=torch.int64, device=self.device)
        # Host frees (logical host locs) held back while batched_host_frees() is open.
        self._deferred_host_frees: Optional[List[torch.Tensor]] = None

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank

    def reset(self) -> None:
        super().reset()
        self.host_table.clear()

    # --------------------------------------------------------------- write (D2H)
    def write(
        self,
        device_indices: torch.Tensor,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools=None,
        plan: Optional[HostWritePlan] = None,
    ) -> Optional[torch.Tensor]:
        """Back up a node given its logical device locs; return its logical host locs.

        ``plan``: the cache's :meth:`CpHostPageTable.plan_write` of ``device_indices``.
        Returns None (on every rank alike) when some owner lane's host pool lacks room;
        the caller reads the deficit from the table before calling, not after.
        """
        if plan is None:
            plan = self.host_table.plan_write(PageRun.of(host_int64(device_indices), self.page_size))
        if not self.host_table.lane_fits(plan.lane_pages):
            return None
        owned = plan.page_owners == self.cp_rank
        if plan.lane_pages[self.cp_rank]:
            physical_device_pages = self.layout.logical_pages_to_physical(
                plan.device_run.pages[owned], validate=False
            )
            physical_device_locs = self.allocator.to_device(
                page_token_locs(physical_device_pages, self.page_size)
            )
            physical_host_locs = super().write(physical_device_locs, priority, node_id, extra_pools)
            if physical_host_locs is None:
                raise CpHiCacheMetadataError(
                    f"node {node_id} on CP rank {self.cp_rank}: host pool refused "
                    f"{len(physical_device_locs)} slots although lane accounting has "
                    f"{self.host_table.lane_free_pages()[self.cp_rank]} free pages"
                )
            owned_physical_host_pages = host_int64(physical_host_locs[:: self.page_size]) // self.page_size
        else:
            owned_physical_host_pages = np.empty(0, dtype=np.int64)
            self._ack_without_transfer(node_id)
        return torch.from_numpy(self.host_table.commit_write(plan, owned_physical_host_pages))

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
        plan: Optional[HostLoadPlan] = None,
    ) -> Optional[torch.Tensor]:
        """Load logical host locs back; return new logical device locs (valid tokens only).

        ``plan``: the cache's :meth:`CpHostPageTable.plan_load` of ``host_indices``. New
        device pages repeat the owner pattern recorded at write time, so every rank finds
        its own pages again. None (on every rank alike) if a lane is short of device pages.
        Planned on the host in NumPy; each index array crosses to the device once.
        """
        if plan is None:
            plan = self.host_table.plan_load(host_int64(host_indices), node_id)
        device_pages = self.allocator.alloc_logical_pages(plan.page_owners, plan.lane_pages)
        if device_pages is None:
            return None

        if plan.lane_pages[self.cp_rank]:
            owned = plan.page_owners == self.cp_rank
            physical_host_locs = torch.from_numpy(self.host_table.owned_host_locs(plan, owned))
            # The owner lanes only hold pages of their owner: no ownership re-check needed.
            physical_device_pages = self.layout.logical_pages_to_physical(
                device_pages[owned], validate=False
            )
            physical_device_locs = self.allocator.to_device(
                page_token_locs(physical_device_pages, self.page_size)
            )
            pool_transfers = self._resolve_pool_transfers_allocation(
                extra_pools,
                alloc_host=False,
                kv_device_indices=physical_device_locs,
                kv_host_indices=physical_host_locs,
            )
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
        return self.allocator.to_device(plan.host_run.relocate(device_pages))

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

    def release_host(self, host_indices: torch.Tensor, node_id: int = -1) -> None:
        """Free a node's host pages: in the table and this rank's host pool now, or, inside
        :meth:`batched_host_frees`, when the batch closes."""
        if self._deferred_host_frees is None:
            self._release_now(host_int64(host_indices), node_id)
        else:  # converted once, when the batch closes
            self._deferred_host_frees.append(host_indices)

    def _release_now(self, logical_host_locs: np.ndarray, node_id: int = -1) -> None:
        owned_physical_pages, _ = self.host_table.release(logical_host_locs, node_id)
        if len(owned_physical_pages):
            self.mem_pool_host.free(
                torch.from_numpy(page_token_locs(owned_physical_pages, self.page_size))
            )

    @contextmanager
    def batched_host_frees(self) -> Iterator[None]:
        """Defer the ``release_host`` calls inside (each node at most once) to one release
        when the batch closes: the same page table and host free list as one release per
        node, in call order, for one table update and one O(free list) host free."""
        self._deferred_host_frees = []
        try:
            yield
        finally:
            deferred, self._deferred_host_frees = self._deferred_host_frees, None
            if deferred:
                self._release_now(host_int64(torch.cat(deferred)))

    # ----------------------------------------------------------------- metrics
    def host_usage(self) -> dict:
        """Logical tokens cached on host (all ranks) and this rank's physical slots."""
        lane_used = self.host_table.lane_used_pages()
        return {
            "logical_tokens": self.host_table.used_logical_tokens(),
            "physical_slots": lane_used[self.cp_rank] * self.page_size,
            "lane_used_pages": lane_used,
        }
