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

Backups go to the host either all layers at once (:meth:`submit_write`, the default: hit-
count backups of computed nodes, write-back eviction) or layer by layer during the forward
that computes them (``submit_write(pending, per_layer=True)``, then :meth:`backup_layer`
from the attention hook). The per-layer pipeline (held writes, the layer batch, the draft
batch, the ack rule, fail-fast) is the shared :class:`PerLayerBackup`
(``core/per_layer_backup.py``); this controller gives it its copies, events and write
stream (:class:`ControllerLayerTransfers`).

With an MTP draft, the host pool is a :class:`CpHostPoolGroup` holding the target's and the
draft's pools over the same physical slots: one reservation, one page table, one transfer
op and one ack per logical backup or load carry both. A per-layer batch acks after the
draft forward's layer (the pipeline's ``draft_stage``, the draft pool's layer listener),
not after the target's last layer: the draft stores its KV only after the target forward.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence, Tuple

import numpy as np
import torch

from sglang.srt.managers.cache_controller import HiCacheAck
from sglang.srt.mem_cache.hybrid_cache import hybrid_cache_controller as _upstream
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import (
    CacheOperation,
    HybridCacheController,
)

from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import (
    PAYLOAD_DRAFT,
    PAYLOAD_TARGET,
    CpHiCacheMetadataError,
    CpHostPageTable,
    HostLoadPlan,
    LoadPlan,
    HostWritePlan,
    PageRun,
)
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64, page_token_locs
from sglang_cp_hicache.core.per_layer_backup import BatchTimeline, PerLayerBackup
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import (
    DraftHostSlotsError,
    HostPoolGroupLayerBackup,
    host_group_bytes,
    layer_backup_for,
)

logger = logging.getLogger(__name__)


@dataclass
class PendingHostWrite:
    """One logical backup between its reservation and its ack.

    ``logical_host_locs`` (identical on every rank) become the node's ``host_value`` only
    when the write commits, and ``load_plan`` (their :class:`HostLoadPlan`, made at the
    reservation) its load plan when it commits whole; ``operation`` is this rank's transfer
    of its owned pages (None on a rank that owns none of them, which still acks once).
    """

    node_id: int
    plan: HostWritePlan
    logical_host_locs: torch.Tensor
    operation: Optional[CacheOperation]
    load_plan: HostLoadPlan

    def assign_node(self, node_id: int) -> None:
        """Name the node a reservation made before it existed belongs to (before submit:
        the ack carries this id)."""
        self.node_id = node_id
        if self.operation is not None:
            self.operation.node_ids = [node_id]


@dataclass
class OwnedLayerTransfer:
    """This rank's owned pages of a batch of per-layer backups, merged and moved once
    (``move_hybrid_indices``): the indices every layer of the batch copies."""

    host_indices: torch.Tensor
    device_indices: torch.Tensor
    pool_transfers: Optional[list]


class ControllerLayerTransfers:
    """What one layer of a per-layer batch moves on this controller's pools, on SGLang's
    ``device_module`` (read at each call: the CPU runtime may bind it after import). The
    :class:`LayerTransfers` and :class:`BackupStreams` of the core pipeline."""

    def __init__(self, controller: "CpHybridCacheController") -> None:
        self.controller = controller

    def merge(self, writes: Sequence[PendingHostWrite]) -> Optional[OwnedLayerTransfer]:
        operations = [write.operation for write in writes if write.operation is not None]
        if not operations:  # this rank owns none of the pages: ack only, no transfer
            return None
        merged = CacheOperation.merge_ops(operations)
        return OwnedLayerTransfer(*self.controller.move_hybrid_indices(merged))

    def copy_layer(self, transfer: OwnedLayerTransfer, layer_id: int) -> None:
        c = self.controller
        c.layer_backup.backup_from_device_per_layer(
            c.mem_pool_device, transfer.host_indices, transfer.device_indices, layer_id,
            c.io_backend, pool_transfers=transfer.pool_transfers,
        )  # fmt: skip

    def copy_draft_layer(self, transfer: OwnedLayerTransfer, layer_id: int) -> None:
        c = self.controller
        c.draft_layer_backup.backup_from_device_per_layer(
            c.draft_device_pool, transfer.host_indices, transfer.device_indices, layer_id,
            c.io_backend,
            pool_transfers=c.mem_pool_host.draft_transfers(transfer.host_indices, transfer.device_indices),
        )  # fmt: skip

    def keep_alive(self, transfer: OwnedLayerTransfer, stream: Any) -> None:
        self.controller._record_transfer_indices_on_stream(
            stream, transfer.host_indices, transfer.device_indices, transfer.pool_transfers
        )

    def ack(self, transfer: Optional[OwnedLayerTransfer], ack_ids: List[int], timeline: BatchTimeline) -> None:
        self.controller.ack_write_queue.append(HiCacheAck(timeline.first_stored, timeline.finished, ack_ids))

    def new_event(self) -> Any:
        return _upstream.device_module.Event()

    @contextmanager
    def on_write_stream(self) -> Iterator[Any]:
        stream = self.controller.write_stream
        with _upstream.device_module.stream(stream):
            yield stream


class CpHybridCacheController(HybridCacheController):
    """``HybridCacheController`` over one rank's owned shards of logical HiCache nodes.

    ``mem_pool_host`` is the target's host group, or a :class:`CpHostPoolGroup` whose
    ``draft`` holds the MTP draft's host pools (target and draft then move together).
    """

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
        self.draft_host = getattr(self.mem_pool_host, "draft", None)
        payload = PAYLOAD_TARGET | (PAYLOAD_DRAFT if self.draft_host is not None else 0)
        self.host_table = CpHostPageTable(
            self.layout, self.mem_pool_host.size // self.page_size, payload=payload
        )
        self._no_locs = torch.empty(0, dtype=torch.int64)
        self._no_device_locs = torch.empty(0, dtype=torch.int64, device=self.device)
        # Host frees (logical host locs) held back while batched_host_frees() is open.
        self._deferred_host_frees: Optional[List[torch.Tensor]] = None
        self._layer_backup = layer_backup_for(self.mem_pool_host)
        self.draft_device_pool: Any = None
        self.draft_layer_backup: Optional[HostPoolGroupLayerBackup] = None
        if self.draft_host is not None:
            self.draft_device_pool = self.mem_pool_host.draft_device_pool
            self.draft_layer_backup = HostPoolGroupLayerBackup(self.draft_host)
        # Per-layer backups: held for the next forward, moved layer by layer during it.
        transfers = ControllerLayerTransfers(self)
        self.layer_pipeline: PerLayerBackup[PendingHostWrite, OwnedLayerTransfer] = PerLayerBackup(
            transfers,
            transfers,
            self.layer_num,
            draft_layer_num=self.draft_device_pool.layer_num if self.draft_host is not None else 0,
            rank_label=f"CP rank {self.cp_rank}",
        )
        cp_layer_backup.register(self.mem_pool_device, self)
        if self.draft_host is not None:
            cp_layer_backup.register(self.draft_device_pool, self.layer_pipeline.draft_stage)

    @property
    def cp_rank(self) -> int:
        return self.layout.cp_rank

    @property
    def has_draft_host(self) -> bool:
        return self.draft_host is not None

    def reset(self) -> None:
        super().reset()
        self.host_table.clear()
        self.layer_pipeline.reset()

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

        Reserve and submit at once (all layers). ``plan``: the cache's
        :meth:`CpHostPageTable.plan_write` of ``device_indices`` (the cache always passes
        one, planned from the node's host-mirrored run, so a backup reads nothing back from
        the device; ``device_indices`` is then unused). Without a plan (direct callers) the
        locs are copied to the host here, a stream sync on a GPU. Returns None (on every
        rank alike) when some owner lane's host pool lacks room; the caller reads the
        deficit from the table before calling, not after.
        """
        if plan is None:
            plan = self.host_table.plan_write(PageRun.of(host_int64(device_indices), self.page_size))
        pending = self.reserve_write(plan, node_id, priority, extra_pools)
        if pending is None:
            return None
        self.submit_write(pending)
        return pending.logical_host_locs

    def reserve_write(
        self,
        plan: HostWritePlan,
        node_id: int = -1,
        priority: Optional[int] = None,
        extra_pools=None,
    ) -> Optional[PendingHostWrite]:
        """Reserve the host pages of one logical backup; queue no transfer.

        The table records the logical host pages (identical on every rank) and this rank's
        physical slots for its owned pages. None (on every rank alike) when some owner lane
        lacks host room. Until :meth:`submit_write` and its ack, nothing may read the
        reserved pages; :meth:`rollback_write` frees exactly this reservation.
        """
        if not self.host_table.lane_fits(plan.lane_pages):
            return None
        operation = None
        if plan.lane_pages[self.cp_rank]:
            owned = plan.page_owners == self.cp_rank
            physical_device_locs = self._physical_device_locs(plan.device_run.pages[owned])
            try:  # with a draft: the same slots in the draft's pools, or nothing
                physical_host_locs = self.mem_pool_host.alloc(len(physical_device_locs))
            except DraftHostSlotsError as error:
                raise CpHiCacheMetadataError(
                    f"node {node_id} on CP rank {self.cp_rank}: {error}; nothing stays reserved"
                ) from None
            if physical_host_locs is None:
                raise CpHiCacheMetadataError(
                    f"node {node_id} on CP rank {self.cp_rank}: host pool refused "
                    f"{len(physical_device_locs)} slots although lane accounting has "
                    f"{self.host_table.lane_free_pages()[self.cp_rank]} free pages"
                )
            pool_transfers = self._resolve_pool_transfers_allocation(
                extra_pools,
                alloc_host=True,
                kv_device_indices=physical_device_locs,
                kv_host_indices=physical_host_locs,
            )
            if pool_transfers is None and extra_pools:
                self.mem_pool_host.free(physical_host_locs)
                raise CpHiCacheMetadataError(
                    f"node {node_id} on CP rank {self.cp_rank}: an extra host pool refused "
                    "the backup after the lane accounting admitted it"
                )
            operation = CacheOperation(
                physical_host_locs,
                physical_device_locs,
                node_id,
                priority,
                pool_transfers=pool_transfers or None,
            )
            owned_physical_host_pages = host_int64(physical_host_locs[:: self.page_size]) // self.page_size
        else:
            owned_physical_host_pages = np.empty(0, dtype=np.int64)
        host_locs = self.host_table.commit_write(plan, owned_physical_host_pages)
        return PendingHostWrite(
            node_id, plan, torch.from_numpy(host_locs), operation, self._reserved_load_plan(plan, host_locs)
        )

    def _reserved_load_plan(self, plan: HostWritePlan, host_locs: np.ndarray) -> HostLoadPlan:
        """The load plan of the host pages just reserved for ``plan``. Made here, off the
        ack path: ``commit_write`` recorded the write plan's owners for those pages, so a
        whole-page run's plan is built from it without the table's gather and payload check
        (``plan_load`` gives the same plan); any other run is planned by the table."""
        if plan.device_run.page_of_loc is not None:
            return self.host_table.plan_load(host_locs)
        page = self.page_size
        run = PageRun(host_locs, host_locs[::page] // page, None, page)
        return self.host_table.load_plan(run, plan.page_owners, plan.lane_pages)

    def submit_write(self, pending: PendingHostWrite, per_layer: bool = False) -> None:
        """Queue the reserved backup's transfer and its one ack.

        All layers now (default); a rank that owns nothing in it acks without transferring.
        ``per_layer``: held for the next model forward, whose layer hook submits it layer
        by layer (:meth:`backup_layer`) and acks it after the last layer. Must be called
        before that forward starts; the forward must run every layer.
        """
        if per_layer:
            self.layer_pipeline.hold(pending)
            return
        if pending.operation is None:
            self._ack_without_transfer(pending.node_id)
            return
        self.write_queue.append(pending.operation)
        self.start_writing()

    @property
    def held_write_node_ids(self) -> List[int]:
        """Node ids of per-layer backups whose ack has not been appended yet."""
        return self.layer_pipeline.held_ack_ids

    @property
    def layer_backup(self) -> HostPoolGroupLayerBackup:
        """The target host group's per-layer D2H adapter (read only)."""
        return self._layer_backup

    def backup_layer(self, layer_id: int) -> None:
        """Layer ``layer_id``'s KV stores of the running forward are issued: submit that
        layer of every held backup as one transfer on the write stream (the device pool's
        layer hook; see :class:`PerLayerBackup`)."""
        self.layer_pipeline.backup_layer(layer_id)

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        """The model forward returned or raised: no per-layer backup may be left behind."""
        self.layer_pipeline.end_forward(error)

    def rollback_write(self, pending: PendingHostWrite) -> None:
        """Free a reservation that was never submitted, or whose ack has completed:
        its logical host pages and this rank's physical slots, nothing else. A per-layer
        backup still waiting for its layers cannot be rolled back (its transfer would write
        into freed pages): roll it back after its ack."""
        if pending.node_id in self.held_write_node_ids:
            raise CpHiCacheMetadataError(
                f"node {pending.node_id} on CP rank {self.cp_rank}: rollback of a per-layer "
                "backup before its last layer was submitted"
            )
        self.release_host(pending.logical_host_locs, pending.node_id)

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
        part_locs = self.load_planned(plan, priority, node_id, extra_pools)
        if part_locs is None:
            return None
        return self.allocator.to_device(np.concatenate(part_locs))

    def load_planned(
        self,
        plan: LoadPlan,
        priority: Optional[int] = None,
        node_id: int = -1,
        extra_pools=None,
    ) -> Optional[List[np.ndarray]]:
        """:meth:`load` of a planned load, returning each part's new logical device locs on
        the host (int64, in part order): the cache keeps them as the loaded nodes' runs, so
        nothing is read back from the device. None if a lane is short of device pages."""
        # Every page must hold all the payloads (target and draft): never a target-only hit.
        self.host_table.check_load_payload(plan, node_id)
        if not self.allocator.lane_fits(plan.lane_pages):
            return None
        parts = plan.parts
        if len(parts) > 1:  # one take merges what it needs itself
            self.allocator.prepare_takes(plan.lane_pages)
        device_pages = [
            self.allocator.take_logical_pages(part.page_owners, part.lane_pages) for part in parts
        ]
        if plan.lane_pages[self.cp_rank]:
            physical_host_locs, physical_device_locs = self._owned_load_locs(parts, device_pages)
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
        return [part.device_locs(pages) for part, pages in zip(parts, device_pages)]

    def _owned_load_locs(
        self, parts: Sequence[HostLoadPlan], device_pages: List[np.ndarray]
    ) -> Tuple[torch.Tensor, torch.Tensor]:
        """Physical host and device locs of this rank's pages of a load (whole pages): the
        host ones from the parts' plans, the device ones from the pages just taken."""
        rank = self.cp_rank
        host_locs, new_pages = [], []
        for part, pages in zip(parts, device_pages):
            owned_count = part.lane_pages[rank]
            if owned_count:
                host_locs.append(part.owned_host_locs)
                # A part this rank owns whole needs no mask.
                new_pages.append(pages if owned_count == len(pages) else pages[part.page_owners == rank])
        if len(host_locs) > 1:
            host_locs, new_pages = [np.concatenate(host_locs)], [np.concatenate(new_pages)]
        # The op reads the plan's locs (nothing writes either in place). The owner lanes
        # only hold pages of their owner.
        return torch.from_numpy(host_locs[0]), self._physical_device_locs(new_pages[0])

    def _physical_device_locs(self, owned_logical_pages: np.ndarray) -> torch.Tensor:
        """This rank's physical device locs (whole pages, on the device) of logical pages it
        owns (not re-checked). One page, the usual node, is mapped in Python ints: on the
        scheduler thread a NumPy division is a cold call that costs more than the rest of
        a load's owned-page work."""
        page = self.page_size
        if len(owned_logical_pages) == 1:
            physical_page = self.layout.logical_pages_to_physical(owned_logical_pages.item(), validate=False)
            locs = np.arange(physical_page * page, (physical_page + 1) * page, dtype=np.int64)
        else:
            physical_pages = self.layout.logical_pages_to_physical(owned_logical_pages, validate=False)
            locs = page_token_locs(physical_pages, page)
        return self.allocator.to_device(locs)

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
        """Logical tokens cached on host (all ranks), this rank's physical slots, and the
        bytes of this rank's host pools (target and, with a draft, draft)."""
        lane_used = self.host_table.lane_used_pages()
        target_group = self.mem_pool_host
        return {
            "logical_tokens": self.host_table.used_logical_tokens(),
            "physical_slots": lane_used[self.cp_rank] * self.page_size,
            "lane_used_pages": lane_used,
            "target_host_bytes": host_group_bytes(target_group),
            "draft_host_bytes": host_group_bytes(self.draft_host) if self.draft_host is not None else 0,
        }
