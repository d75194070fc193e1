"""``HiRadixCache`` in CP shared-KV mode (installed by REPLACE over SGLang's class).

With a plain allocator this class is :class:`FastHiRadixCache` (upstream's decisions, see
that module for what differs from upstream). With :class:`CPSharedPagedTokenToKVPoolAllocator`
it adds only the CP deltas, as policy; the controller is mechanism:

* the controller becomes :class:`CpHybridCacheController`, which backs up and loads only
  this rank's owned pages (MLA KV and indexer K/scale) and hands the tree *logical* host
  locs, so every upstream read of ``host_value`` (hit lengths, load-back threshold and
  quota, splits, device-index slicing after load) is logical and rank-invariant;
* a backup is planned here (:meth:`CpHostPageTable.plan_write`: each page's owner lane),
  host room is made on the short lanes only, then the controller executes the plan;
* a load-back is planned here (write-time owners per page), device room is made on the
  short lanes only, then the controller executes the plan;
* room is made by :func:`plan_lane_victims`: victims in (priority, node id) order among
  the leaves that hold pages on a short lane, planned before anything is evicted; when
  the short lanes cannot be covered nothing is evicted and the backup or load is refused
  (counted in :attr:`capacity_refusals`; the node stays device-only, the request
  recomputes its prefix, as upstream does when room runs out);
* load-back admission counts device-evictable cache in its quota;
* a backup is pending (:class:`PendingBackup`: host pages reserved, transfer submitted)
  and invisible (no ``host_value``) until its one final ack commits it in
  ``writing_check``; a full lane gets room made and one retry, else a counted skip; a
  match never splits a pending node (the request waits a round, see
  ``managers/schedule_policy.py``), an insert's split hands the fragment its host slice
  at the commit (docs/cp_hicache_design.md, "Backup state machine");
* a new leaf's backup is reserved before its forward and, with :attr:`per_layer_backup`,
  submitted then, so the forward's layer hooks move it layer by layer; its ack carries a
  ticket until the insert names the leaf (the shared state machine
  :class:`ForwardReservations`, ``core/forward_reservations.py``: this class does what it
  decides);
* with the MTP draft's pool handed over (:func:`draft_kv_pool_scope`, by the scheduler
  hook), the draft's KV is kept on host with the target's as one object
  (:class:`CpHostPoolGroup`): both sized from the target's budget, the same slots, one
  page table and one ack (docs/cp_hicache_design.md, "Draft (MTP) KV").

Per node, the replicated lane state the planners read is kept on the node (never recomputed
per eviction call): ``cp_device_locs`` (the node's logical device locs on the host),
``cp_device_run`` / ``cp_device_lanes`` (its pages and pages per owner lane, derived from
``cp_device_locs`` on a planner's first use and kept until the value changes),
``cp_host_lanes`` (host pages per owner lane) and ``cp_host_plan`` (the
:class:`HostLoadPlan` of the node's host value, made when it is backed up or split: the only
two places a CP host value is set, so a load joins plans instead of deriving them;
``cp_host_plan_source`` is the host value it was made from, which a load checks by identity).

``cp_device_locs`` comes from host state, never from reading ``node.value`` back (a stream
sync per node on a GPU): a node inserted by ``cache_finished_req`` / ``cache_unfinished_req``
takes its slice of the request's row of :class:`ReqToTokenHostMirror` (written where SGLang
allocates, ``mem_cache/common.py``), a loaded node its slice of the load plan's new locs, a
split node its part of the locs. Only a direct :meth:`insert` without a request (unit tests,
benchmarks) leaves them to be read from ``node.value`` on first use: counted in
:attr:`device_value_reads`, and warned once when the value is on a real device.
"""

from __future__ import annotations

import contextvars
import copy
import logging
import time
from contextlib import closing, contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Optional, Set

import numpy as np
import torch

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import (
    CpHiCacheMetadataError,
    CpHiCacheNodeMetadata,
    HostLoadPlan,
    JoinedHostLoadPlan,
    LoadPlan,
    HostWritePlan,
    PageRun,
)
from sglang_cp_hicache.v0_5_12.mem_cache.cp_lane_eviction import plan_lane_victims
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64
from sglang_cp_hicache.core.forward_reservations import ForwardReservations, Next, Transition
from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import CPU, FastHiRadixCache, host_evictable
from sglang_cp_hicache.v0_5_12.mem_cache.hybrid_cache.cp_hybrid_cache_controller import (
    CpHybridCacheController,
    PendingHostWrite,
)
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import ReqToTokenHostMirror
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import (
    CpHostPoolGroup,
    HostBudgetSplit,
    build_nsa_host_group,
    hicache_ratio_for_pages,
    split_host_budget,
)
from sglang_cp_hicache.v0_5_12.server_args import (
    CLI_FLAG,
    CpSharedKVConfigError,
    unsupported_cache_combinations,
)

logger = logging.getLogger(__name__)

# The MTP draft's device KV pool the next CP HiRadixCache is built with (set by the
# scheduler hook around init_cache_with_memory_pool; SGLang's CacheInitParams has no field).
_draft_kv_pool: contextvars.ContextVar[Any] = contextvars.ContextVar("cp_hicache_draft_kv_pool", default=None)


@contextmanager
def draft_kv_pool_scope(draft_kv_pool: Any) -> Iterator[None]:
    """A CP HiRadixCache built inside keeps ``draft_kv_pool``'s KV on host with the
    target's: one host object, one budget, one page table, one ack."""
    token = _draft_kv_pool.set(draft_kv_pool)
    try:
        yield
    finally:
        _draft_kv_pool.reset(token)


@dataclass
class CapacityRefusals:
    """Backups and loads refused because their short lanes could not be covered."""

    host_writes: int = 0
    device_loads: int = 0


@dataclass
class PendingBackup:
    """A CP backup between its host reservation and its one final ack.

    Created when the transfer and its ack are queued (the node is then in
    ``ongoing_write_through``, locked). Until the ack commits it, the node has no
    ``host_value`` (not ``backuped``): it is no ``last_host_node``, no host-eviction
    victim, and a split never cuts its host pages.
    """

    node: TreeNode
    write: PendingHostWrite


@dataclass
class PendingBackupStats:
    """Replicated counts of the pending-backup state machine (identical on every rank)."""

    committed: int = 0
    rolled_back: int = 0
    deferred_splits: int = 0  # matches that stopped above a pending node instead of splitting it


class CpHiRadixCache(FastHiRadixCache):
    """HiRadixCache whose host tier stores only this CP rank's owned KV shards."""

    def __init__(self, params, server_args) -> None:
        allocator = params.token_to_kv_pool_allocator
        self.uses_cp_hicache = isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator)
        self.draft_kv_pool: Any = None
        self.host_budget: Optional[HostBudgetSplit] = None
        if self.uses_cp_hicache:
            problems = unsupported_cache_combinations(server_args)
            if problems:
                raise CpSharedKVConfigError("; ".join(problems))
            server_args = self._size_host_pools_for_draft(allocator.get_kvcache(), params.page_size, server_args)
        # Before super(): its __init__ calls reset(). Keyed by the reserving node's id.
        self.pending_backups: Dict[int, PendingBackup] = {}
        # Reserved before the forward for the leaves the inserts will create; per layer,
        # their acks carry tickets (in ongoing_write_through until the claim or the ack).
        self.forward_reservations: ForwardReservations[PendingHostWrite, TreeNode] = ForwardReservations()
        # Backups of new leaves move during their forward, layer by layer. Off: submitted
        # all layers at once at the insert (tests and the simulator's comparison runs).
        self.per_layer_backup = True
        self.pending_stats = PendingBackupStats()
        # Host form of the value being placed on nodes (a request's mirrored row inside
        # cache_*_req); None outside those calls.
        self._value_source: Optional[np.ndarray] = None
        # Each loaded node's new locs on the host by its offset in the load (in load_back).
        self._loaded_locs: Optional[Dict[int, np.ndarray]] = None
        self.device_value_reads = 0  # runs derived by reading node.value back
        self._warned_device_read = False
        super().__init__(params, server_args)
        self.capacity_refusals = CapacityRefusals()
        self._warned_refusals: Set[str] = set()
        self.req_loc_mirror: Optional[ReqToTokenHostMirror] = None
        if not self.uses_cp_hicache:
            return
        self.req_loc_mirror = ReqToTokenHostMirror(*params.req_to_token_pool.req_to_token.shape)
        self.layout = allocator.layout
        if self.draft_kv_pool is not None:
            # Same pages as the target's (one page table, the same physical slots).
            draft_host = build_nsa_host_group(
                self.draft_kv_pool, self.host_budget.pages, self.page_size, self.token_to_kv_pool_host.layout
            )
            self.token_to_kv_pool_host = CpHostPoolGroup(self.token_to_kv_pool_host, draft_host)
        self.cache_controller = self._build_cp_controller(self.cache_controller)
        self.host_table = self.cache_controller.host_table
        logger.info(
            "CP HiCache on rank %d/%d: %d physical host slots per rank, %d logical host tokens%s",
            self.layout.cp_rank,
            self.layout.cp_size,
            self.token_to_kv_pool_host.size,
            self.host_table.num_logical_pages * self.page_size,
            "" if self.host_budget is None else (
                f"; with the MTP draft's KV in the same slots, target {self.host_budget.target_bytes} "
                f"+ draft {self.host_budget.draft_bytes} bytes of the {self.host_budget.budget_bytes}-byte "
                f"budget ({self.host_budget.target_pages_alone} pages without a draft)"
            ),
        )

    def _size_host_pools_for_draft(self, kv_cache: Any, page_size: int, server_args: Any) -> Any:
        """With an MTP draft (handed over by :func:`draft_kv_pool_scope`): the server args
        that make SGLang's assembler build the target's host pools at the pages the target
        and draft get from the target's budget (:func:`split_host_budget`); without one,
        ``server_args`` as given. Never lets a speculative server run without its draft
        pool on host."""
        draft_pool = _draft_kv_pool.get()
        algorithm = getattr(server_args, "speculative_algorithm", None)
        if draft_pool is None:
            if algorithm:
                raise CpSharedKVConfigError(
                    f"{CLI_FLAG} with --enable-hierarchical-cache and --speculative-algorithm "
                    f"{algorithm}: the CP HiRadixCache was built without the draft's KV pool, so "
                    "draft KV would not be kept on host with the target's (the scheduler hands "
                    "it over around Scheduler.init_cache_with_memory_pool; build the cache "
                    "inside hiradix_cache.draft_kv_pool_scope)"
                )
            return server_args
        for name, pool in (("target", kv_cache), ("draft", draft_pool)):
            if not isinstance(pool, NSATokenToKVPool):
                raise CpSharedKVConfigError(
                    f"{CLI_FLAG} keeps the MTP draft's KV on host only for NSA pools; the "
                    f"{name} pool is {type(pool).__name__}"
                )
        if draft_pool.size != kv_cache.size or draft_pool.page_size != page_size:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG}: the draft KV pool ({draft_pool.size} slots, page "
                f"{draft_pool.page_size}) must mirror the target's ({kv_cache.size} slots, page "
                f"{page_size}) to share its host slots"
            )
        split = split_host_budget(
            kv_cache, draft_pool, page_size, server_args.hicache_ratio, server_args.hicache_size
        )
        if split.tokens <= kv_cache.size:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} with the MTP draft on host: the per-rank host budget of "
                f"{split.budget_bytes} bytes (--hicache-ratio {server_args.hicache_ratio}, "
                f"--hicache-size {server_args.hicache_size}) holds {split.pages} pages of target "
                f"+ draft KV, not more than the device pool's {kv_cache.size // page_size} pages "
                "(SGLang needs a larger host pool); raise --hicache-ratio or --hicache-size"
            )
        self.draft_kv_pool, self.host_budget = draft_pool, split
        sized = copy.copy(server_args)
        sized.hicache_size = 0
        sized.hicache_ratio = hicache_ratio_for_pages(kv_cache, split.pages, page_size)
        return sized

    def check_draft_kv_pool(self, draft_kv_pool: Any) -> None:
        """Fail fast unless this cache keeps exactly ``draft_kv_pool``'s KV on host (the
        scheduler's draft pool; None: no draft). Replaces upstream's MLA-only draft host
        pool registration under the flag."""
        if draft_kv_pool is self.draft_kv_pool:
            return
        rank = self.layout.cp_rank if self.uses_cp_hicache else 0
        if draft_kv_pool is None:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} on CP rank {rank}: the CP HiRadixCache keeps a draft KV pool on "
                "host but the scheduler has no draft worker"
            )
        if self.draft_kv_pool is None:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} on CP rank {rank}: the scheduler has a draft KV pool "
                f"({type(draft_kv_pool).__name__}) but the CP HiRadixCache was built without it: "
                "draft KV would not be kept on host with the target's"
            )
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} on CP rank {rank}: the CP HiRadixCache keeps another draft KV pool on "
            f"host than the scheduler's ({type(draft_kv_pool).__name__})"
        )

    def _build_cp_controller(self, upstream: Any) -> CpHybridCacheController:
        if not isinstance(self.kv_cache, NSATokenToKVPool):
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} with HiCache needs the NSA KV pool, got {type(self.kv_cache).__name__}"
            )
        # Same arguments as the upstream assembler used; the host pool group is reused
        # (with a draft: inside the one target + draft host object).
        return CpHybridCacheController(
            upstream.mem_pool_device_allocator,
            self.token_to_kv_pool_host,
            self.page_size,
            upstream.tp_group,
            load_cache_event=self.load_cache_event,
            attn_cp_group=upstream.attn_cp_group,
            attn_tp_group=upstream.attn_tp_group,
            write_policy=upstream.write_policy,
            io_backend=upstream.io_backend,
            storage_backend=None,
            pp_rank=upstream.pp_rank,
            pp_size=upstream.pp_size,
            transfer_layer_num=upstream.layer_num,
        )

    # ------------------------------------------------------- per-node lane state
    @contextmanager
    def _placing(self, host_locs: Optional[np.ndarray]) -> Iterator[None]:
        """Nodes given a device value inside take their runs from ``host_locs`` (the host
        form of the value being placed, indexed by the offsets ``_on_device_value`` gets),
        or inside a load from the loaded nodes' own new locs (``_loaded_locs``)."""
        self._value_source, self._loaded_locs = host_locs, None
        try:
            yield
        finally:
            self._value_source, self._loaded_locs = None, None

    def _on_device_value(self, node: TreeNode, start: int) -> None:
        if not self.uses_cp_hicache:
            return
        # The run and lanes are derived when a planner first needs them: many nodes never
        # meet a planner before their value changes.
        node.cp_device_run = None
        if self._loaded_locs is not None:  # made for this node alone
            node.cp_device_locs = self._loaded_locs[start]
        elif self._value_source is not None:  # a request's mirror row, which is reused
            node.cp_device_locs = self._value_source[start : start + len(node.value)].astype(np.int64)
        else:
            node.cp_device_locs = None  # no host form: read back on first use (counted)

    def _device_locs(self, node: TreeNode) -> np.ndarray:
        """The node's logical device locs on the host (replicated state)."""
        locs = getattr(node, "cp_device_locs", None)
        if locs is None:
            locs = node.cp_device_locs = self._read_device_value(node)
        return locs

    def _device_run(self, node: TreeNode) -> PageRun:
        """The node's logical device pages (replicated state)."""
        run = getattr(node, "cp_device_run", None)
        if run is None:
            run = self._set_device_run(node, PageRun.of(self._device_locs(node), self.page_size))
        return run

    def _read_device_value(self, node: TreeNode) -> np.ndarray:
        """``node.value`` read back to the host: only for nodes inserted without a request."""
        self.device_value_reads += 1
        if node.value.device.type != "cpu" and not self._warned_device_read:
            self._warned_device_read = True
            logger.warning(
                "CP HiCache on rank %d: node %d was given device locs without their host form "
                "(an insert outside cache_finished_req/cache_unfinished_req); its locs are read "
                "back from the device, a stream sync (logged once; counted in "
                "device_value_reads)",
                self.layout.cp_rank,
                node.id,
            )
        return host_int64(node.value)

    def device_prefix_locs(self, node: TreeNode) -> np.ndarray:
        """Logical device locs of the path root -> ``node`` (a device node), on the host,
        from the nodes' host locs: what ``match_prefix`` returns as ``device_indices``."""
        parts = []
        while node is not self.root_node:
            parts.append(self._device_locs(node))
            node = node.parent
        return np.concatenate(parts[::-1]) if parts else np.empty(0, dtype=np.int64)

    def _device_lanes(self, node: TreeNode) -> List[int]:
        """The node's device pages per owner lane."""
        self._device_run(node)
        return node.cp_device_lanes

    def _set_device_run(self, node: TreeNode, run: PageRun) -> PageRun:
        node.cp_device_run = run
        node.cp_device_lanes = np.bincount(
            self.layout.owner_for_logical_pages(run.pages), minlength=self.layout.cp_size
        ).tolist()
        return run

    def node_host_metadata(self, node: TreeNode) -> Optional[CpHiCacheNodeMetadata]:
        """This rank's host shard of ``node`` (None if the node is not backed up)."""
        if not self.uses_cp_hicache or node.host_value is None or node is self.root_node:
            return None
        return self.host_table.node_metadata(node.host_value, node.id)

    def _split_node(self, key, child: TreeNode, split_len: int):
        if not self.uses_cp_hicache:
            return super()._split_node(key, child, split_len)
        before = self.node_host_metadata(child)
        new_node = super()._split_node(key, child, split_len)
        # Both halves' runs are derived again, from their part of the locs, on first use.
        new_node.cp_device_run = new_node.cp_device_locs = child.cp_device_run = None
        locs = getattr(child, "cp_device_locs", None)
        if child.value is not None and locs is not None:
            new_node.cp_device_locs, child.cp_device_locs = locs[:split_len], locs[split_len:]
        if before is not None:
            # Fails fast (node id, rank) if the split cut a page: one physical host page
            # would then back two nodes.
            expected_parent, expected_child = before.split(split_len)
            for node, expected in ((new_node, expected_parent), (child, expected_child)):
                actual = self.node_host_metadata(node)
                if not torch.equal(actual.host_indices, expected.host_indices):
                    raise CpHiCacheMetadataError(
                        f"CP HiCache split of node {child.id} on CP rank "
                        f"{self.layout.cp_rank}: host shards diverged from metadata"
                    )
                self._set_host_plan(node)
        return new_node

    def _set_host_plan(self, node: TreeNode, plan: Optional[HostLoadPlan] = None) -> None:
        """Plan the load of ``node``'s host value now: it stays fixed until a split, which
        plans both halves again, so a load reads the plan instead of deriving it.
        ``plan``: the reservation's plan of a write that committed ``node.host_value`` whole
        (:attr:`PendingHostWrite.load_plan`, made off the ack path)."""
        if plan is None:
            plan = self.host_table.plan_load(host_int64(node.host_value), node.id)
        node.cp_host_plan = plan
        node.cp_host_lanes = plan.lane_pages
        node.cp_host_plan_source = node.host_value  # the value planned, by identity

    def _host_load_plan(self, nodes: List[TreeNode]) -> LoadPlan:
        """The load plan of consecutive host-only ``nodes`` from their own plans; fails
        fast on a node whose plan does not cover its value."""
        plans = []
        for node in nodes:
            plan = getattr(node, "cp_host_plan", None)
            if plan is None or node.cp_host_plan_source is not node.host_value:
                raise CpHiCacheMetadataError(
                    f"node {node.id} on CP rank {self.layout.cp_rank}: its host load plan does "
                    "not match its host value (a host value set without _set_host_plan)"
                )
            plans.append(plan)
        if len(plans) == 1:
            return plans[0]
        return JoinedHostLoadPlan(plans)

    # -------------------------------------------------------------- backup (D2H)
    def write_backup(self, node: TreeNode, write_back: bool = False) -> int:
        """Upstream's backup, planned per owner lane and pending until its final ack.

        The host pages are reserved (on a full lane: room is made on the short lanes, then
        one retry; else a counted skip leaves the node device-valid, host-none), then the
        transfer is submitted. The node becomes host-visible only when
        :meth:`_publish_backup` commits the ack.
        """
        if not self.uses_cp_hicache:
            return super().write_backup(node, write_back)
        if self._pending_write_id(node) is not None:
            return 0  # already pending, itself or as a fragment of a pending node
        if not write_back and not self._may_back_up_under(node.parent):
            return 0
        claim = self.forward_reservations.claim(node, self._device_run(node).pages)
        record = self._reserve_backup(node, claim)
        if record is None:
            return 0
        if claim is not None and claim.next is Next.COMMIT:
            # Its per-layer transfer landed on every rank before this claim: commit now.
            self._commit_backup(record)
            self._record_store_event(node, medium=CPU)
            return len(record.write.logical_host_locs)
        self.pending_backups[node.id] = record
        if claim is None or claim.next is Next.SUBMIT:
            self.cache_controller.submit_write(record.write)  # all layers, one ack
        else:  # submitted before the forward: its ack (by ticket) now commits this node
            del self.ongoing_write_through[claim.reservation.ticket]
        self.ongoing_write_through[node.id] = node
        if not write_back:
            self.inc_lock_ref(node)
        return len(record.write.logical_host_locs)

    def _reserve_backup(self, node: TreeNode, claim: Optional[Transition]) -> Optional[PendingBackup]:
        """``node``'s host pages per owner lane (no transfer): those reserved before the
        forward for this leaf (``claim``) if any, else a new reservation; None after a
        counted skip."""
        if claim is not None:
            write = claim.reservation.write
            if claim.next is Next.SUBMIT:  # not submitted yet: its ack will name the node
                write.assign_node(node.id)
        else:
            write = self._reserve(self.host_table.plan_write(self._device_run(node)), node.id)
        if write is None:
            return None
        return PendingBackup(node, write)

    def _reserve(self, plan: HostWritePlan, node_id: int) -> Optional[PendingHostWrite]:
        """Reserve ``plan``; on a short lane make room there (host-only victims) and retry
        once; None after a counted skip (nothing stays reserved)."""
        write = self._reserve_write(node_id, plan)
        if write is None and self._make_host_room(plan.lane_pages):
            write = self._reserve_write(node_id, plan)  # the one retry
        if write is None:
            self._refuse("host_writes", node_id, plan.lane_pages, self.host_table.lane_free_pages())
        return write

    def _reserve_write(self, node_id: int, plan: HostWritePlan) -> Optional[PendingHostWrite]:
        return self.cache_controller.reserve_write(plan, node_id, **self._get_extra_pools())

    # ------------------------------------------------- reservation before the forward
    def reserve_for_extend(self, req: Any) -> bool:
        """Before the forward of ``req`` (its ``req_to_token`` row is written): reserve host
        pages for the leaf its insert will create, so the transfer can start during the
        forward. The probe walks the *final* insertion key (bigram and page-aligned as
        ``insert`` sees it), not ``cache_protected_len``: pages another request has cached
        since the match are not reserved twice. True if a reservation was made; the insert
        claims it (:meth:`write_backup`), :meth:`_settle_forward_reservation` rolls back
        one left unclaimed (insert miss, abort, retraction)."""
        if not self.uses_cp_hicache or not self._backs_up_new_leaves(req):
            return False
        key = RadixKey(req.fill_ids, req.extra_key, is_bigram=self.is_eagle).page_aligned(self.page_size)
        # The mirrored row, not req_to_token: no device read before the forward.
        value = self.req_loc_mirror.row(req.req_pool_idx)[: len(key)]
        key, value = key.maybe_to_bigram_view(self.is_eagle, value)
        key = key.page_aligned(self.page_size)
        matched, parent = self._probe_insert(key)
        if matched == len(key) or not self._may_back_up_under(parent):
            return False
        run = PageRun.of(value[matched : len(key)].astype(np.int64), self.page_size)
        write = self._reserve(self.host_table.plan_write(run), -1)
        if write is None:
            return False
        self._settle_forward_reservation(req)  # a chunk's earlier reservation, if any
        reservation = self.forward_reservations.reserve(req.rid, write, run.pages, self.per_layer_backup)
        if reservation.ticket is not None:
            write.assign_node(reservation.ticket)
            self.cache_controller.submit_write(write, per_layer=True)
            self.ongoing_write_through[reservation.ticket] = None  # no node yet
        return True

    def _backs_up_new_leaves(self, req: Any) -> bool:
        """A new leaf is backed up at its insert: write-through (threshold 1) or chunked."""
        policy = self.cache_controller.write_policy
        return policy == "write_through" or (policy != "write_back" and getattr(req, "is_chunked", 0) > 0)

    def _probe_insert(self, key: RadixKey) -> "tuple[int, TreeNode]":
        """How much of ``key`` the tree holds now, and the node the new leaf would hang
        under (a node the insert would split stands for its prefix fragment). Read-only."""
        node, matched = self.root_node, 0
        while len(key) > 0:
            child = node.children.get(key.child_key(self.page_size))
            if child is None:
                break
            prefix_len = child.key.match(key, page_size=self.page_size)
            matched += prefix_len
            node = child
            if prefix_len < len(child.key):
                break
            key = key[prefix_len:]
        return matched, node

    def _may_back_up_under(self, parent: TreeNode) -> bool:
        """Write-through keeps backed-up nodes a contiguous prefix from the root: the
        parent is backed up or pending (its ack pops first, acks pop in order)."""
        return parent is self.root_node or parent.backuped or self._pending_write_id(parent) is not None

    def _settle_forward_reservation(self, req: Any) -> None:
        """After the insert (or instead of it): roll back what the insert did not claim,
        now, or at its ack when its per-layer transfer may still be writing."""
        settle = self.forward_reservations.settle(req.rid)
        if settle is not None and settle.next is Next.ROLL_BACK:
            self._roll_back(settle.reservation.write)

    def _land_reservation(self, ticket: int) -> Optional[TreeNode]:
        """The ack of a per-layer reservation popped: commit the node that claimed it (its
        node, to unlock), roll back one left unclaimed, or leave it for its claim."""
        landing = self.forward_reservations.land(ticket)
        if landing.next is Next.COMMIT:
            return self._publish_backup(landing.reservation.node.id)
        del self.ongoing_write_through[ticket]
        if landing.next is Next.ROLL_BACK:
            self._roll_back(landing.reservation.write)
        return None

    def _roll_back(self, write: PendingHostWrite) -> None:
        self.cache_controller.rollback_write(write)
        self.pending_stats.rolled_back += 1

    # ----------------------------------------------------- request inserts
    def cache_finished_req(self, req: Any, is_insert: bool = True) -> None:
        """Upstream's, with the inserted nodes' runs taken from the request's mirrored row;
        then what the insert did not claim of the reservation made before the forward is
        rolled back. A request that finishes (not a retraction) first counts its prompt's
        pages as sent by their owners (what a PD prefill sends), for the allocator's
        placement of fresh chains."""
        if not self.uses_cp_hicache:
            return super().cache_finished_req(req, is_insert)
        if is_insert:
            prompt_len = min(len(req.origin_input_ids), req.kv_committed_len)
            prompt_locs = self.req_loc_mirror.read(req.req_pool_idx, 0, prompt_len)
            self.token_to_kv_pool_allocator.count_sent_pages(prompt_locs[:: self.page_size] // self.page_size)
        with self._placing(self.req_loc_mirror.row(req.req_pool_idx)):
            super().cache_finished_req(req, is_insert)
        self._settle_forward_reservation(req)

    def cache_unfinished_req(self, req: Any, chunked: bool = False) -> None:
        """As :meth:`cache_finished_req`; the mirror follows upstream's rewrite of
        ``req_to_token`` with the re-matched prefix (positions another request had inserted
        first now hold the tree's locs)."""
        if not self.uses_cp_hicache:
            return super().cache_unfinished_req(req, chunked)
        with self._placing(self.req_loc_mirror.row(req.req_pool_idx)):
            super().cache_unfinished_req(req, chunked)
        self.req_loc_mirror.write(req.req_pool_idx, 0, self.device_prefix_locs(req.last_node))
        self._settle_forward_reservation(req)

    def _publish_backup(self, node_id: int) -> Optional[TreeNode]:
        if self.forward_reservations.in_flight(node_id):
            return self._land_reservation(node_id)
        record = self.pending_backups.pop(node_id, None)
        if record is not None:
            self._commit_backup(record)
        return super()._publish_backup(node_id)

    def _commit_backup(self, record: PendingBackup) -> None:
        """The final ack landed on every rank: the node and every fragment split off it
        while pending take their slices of the reserved logical host locs."""
        fragments = self._pending_fragments.get(record.node.id)
        if not fragments:
            self._commit_unsplit(record)
            return
        fragment_ids = {f.id for f in fragments}
        chain = [record.node]  # splits keep fragments on the path above the node
        while chain[-1].parent.id in fragment_ids:
            chain.append(chain[-1].parent)
        if len(chain) != len(fragment_ids) + 1:
            raise CpHiCacheMetadataError(
                f"node {record.node.id} on CP rank {self.layout.cp_rank}: the fragments of "
                "its pending backup are not one path above it"
            )
        locs, offset = record.write.logical_host_locs, 0
        for part in reversed(chain):
            part.host_value = locs[offset : offset + len(part.key)].clone()
            self._set_host_plan(part)
            offset += len(part.key)
        if offset != len(locs):
            raise CpHiCacheMetadataError(
                f"node {record.node.id} on CP rank {self.layout.cp_rank}: its pending backup "
                f"reserved {len(locs)} host locs for {offset} tokens"
            )
        self.pending_stats.committed += 1

    def _commit_unsplit(self, record: PendingBackup) -> None:
        """:meth:`_commit_backup` of a node nothing was split off while pending (the usual
        case, on every step's ack path): the node takes the write's host locs whole and the
        load plan its reservation made, so the ack asks the page table nothing."""
        node, write = record.node, record.write
        num_locs = len(write.load_plan.host_run.locs)
        if num_locs != len(node.key):
            raise CpHiCacheMetadataError(
                f"node {node.id} on CP rank {self.layout.cp_rank}: its pending backup "
                f"reserved {num_locs} host locs for {len(node.key)} tokens"
            )
        # No clone: the locs are the write's own array (commit_write made it), and the
        # write dies with its record here.
        node.host_value = write.logical_host_locs
        self._set_host_plan(node, write.load_plan)
        self.pending_stats.committed += 1

    def _defers_split(self, node: TreeNode) -> bool:
        """A match never splits a pending backup: the request waits for its commit."""
        if not self.uses_cp_hicache or self._pending_write_id(node) is None:
            return False
        self.pending_stats.deferred_splits += 1
        self._match_deferred = True
        return True

    def _make_host_room(self, lane_pages: List[int]) -> bool:
        """Evict host-only leaves until every lane has ``lane_pages``; False (nothing
        evicted) if the leaves holding pages on the short lanes cannot cover them."""
        if self.host_table.lane_fits(lane_pages):  # the usual case: no deficit list to build
            return True
        deficit = self.host_table.lane_deficit(lane_pages)
        candidates = self.evictable_host_leaves.victims(host_evictable)
        with closing(candidates):
            victims = plan_lane_victims(
                candidates,
                deficit,
                lambda node: node.cp_host_lanes,
                self._freed_host_parent,
                self.eviction_strategy.strategy.get_priority,
            )
            if victims is None:
                return False
            with self.cache_controller.batched_host_frees():
                for node in victims:
                    self._detach_host_leaf(node)
                    self.cache_controller.release_host(node.host_value, node.id)
        return True

    def _freed_host_parent(self, node: TreeNode, planned: Set[TreeNode]) -> Optional[TreeNode]:
        """``node``'s parent if it becomes a host-evictable leaf once ``planned`` are gone."""
        parent = node.parent
        if parent is self.root_node or not host_evictable(parent) or parent.lock_ref > 0:
            return None
        if any(child.backuped and child not in planned for child in parent.children.values()):
            return None
        return parent

    # ---------------------------------------------------------------- load (H2D)
    def _default_load_quota(self) -> Optional[int]:
        if not self.uses_cp_hicache:
            return super()._default_load_quota()
        # Upstream passes no quota; count what eviction could free, not only free slots.
        return self.token_to_kv_pool_allocator.available_size() + self.evictable_size()

    def load_back(self, node: TreeNode, mem_quota: Optional[int] = None) -> Optional[torch.Tensor]:
        if not self.uses_cp_hicache:
            return super().load_back(node, mem_quota)
        with self._placing(None):  # _load_host_values places the loaded locs
            return super().load_back(node, mem_quota)

    def _load_host_values(self, hit_node: TreeNode, nodes_to_load: List[TreeNode]) -> Optional[torch.Tensor]:
        """Plan the load per owner lane (write-time owners), make device room on the short
        lanes only, then let the controller execute the plan, which returns each node's new
        locs on the host: the loaded nodes' runs."""
        if not self.uses_cp_hicache:
            return super()._load_host_values(hit_node, nodes_to_load)
        plan = self._host_load_plan(nodes_to_load)
        if not self._make_device_room(plan.lane_pages):
            self._refuse(
                "device_loads", hit_node.id, plan.lane_pages,
                self.token_to_kv_pool_allocator.lane_free_pages(),
            )  # fmt: skip
            return None
        part_locs = self.cache_controller.load_planned(
            plan, node_id=hit_node.id, **self._get_extra_pools()
        )
        if part_locs is None:
            raise CpHiCacheMetadataError(
                f"node {hit_node.id} on CP rank {self.layout.cp_rank}: the planned load found "
                "its lanes short of device pages"
            )
        # In load_back's _placing: each loaded node takes its part, by its offset in the load.
        self._loaded_locs, offset = {}, 0
        for locs in part_locs:
            self._loaded_locs[offset] = locs
            offset += len(locs)
        logical_locs = part_locs[0] if len(part_locs) == 1 else np.concatenate(part_locs)
        return self.token_to_kv_pool_allocator.to_device(logical_locs)

    def _make_device_room(self, lane_pages: List[int]) -> bool:
        """Evict device leaves until every lane has ``lane_pages`` free; False (nothing
        evicted) if the leaves holding pages on the short lanes cannot cover them."""
        allocator: CPSharedPagedTokenToKVPoolAllocator = self.token_to_kv_pool_allocator
        if allocator.lane_fits(lane_pages):  # the usual case: no deficit list to build
            return True
        deficit = allocator.lane_deficit(lane_pages)
        candidates = self.evictable_leaves.victims()
        with closing(candidates):
            victims = plan_lane_victims(
                candidates,
                deficit,
                self._device_lanes,
                self._freed_device_parent,
                self.eviction_strategy.strategy.get_priority,
            )
            if victims is None:
                return False
            return self._evict_planned_device(victims, lane_pages)

    def _evict_planned_device(self, victims: List[TreeNode], lane_pages: List[int]) -> bool:
        """Evict the planned device victims in plan order; whether ``lane_pages`` fit now."""
        allocator: CPSharedPagedTokenToKVPoolAllocator = self.token_to_kv_pool_allocator
        start_time = time.perf_counter()
        write_back = self.cache_controller.write_policy == "write_back"
        if write_back:
            for node in victims:
                if not node.backuped:
                    self.write_backup(node, write_back=True)
            self.writing_check(write_back=True)
        evicted = 0
        with self._batched_device_frees():
            for node in victims:
                # A write-back the host refused leaves its node (and so its parent) on device.
                if node in self.evictable_leaves and (node.backuped or not write_back):
                    evicted += self._evict_device_node(node)
        self.update_eviction_metrics(evicted, start_time)
        return not any(allocator.lane_deficit(lane_pages))

    def _freed_device_parent(self, node: TreeNode, planned: Set[TreeNode]) -> Optional[TreeNode]:
        """``node``'s parent if it becomes an evictable device leaf once ``planned`` are gone."""
        parent = node.parent
        if parent is self.root_node or parent.evicted or parent.lock_ref > 0:
            return None
        if any(not child.evicted and child not in planned for child in parent.children.values()):
            return None
        return parent

    def _refuse(self, kind: str, node_id: int, lane_pages: List[int], lane_free: List[int]) -> None:
        setattr(self.capacity_refusals, kind, getattr(self.capacity_refusals, kind) + 1)
        if kind not in self._warned_refusals:
            self._warned_refusals.add(kind)
            logger.warning(
                "CP HiCache: %s for node %d refused: it needs %s pages per owner lane, %s are "
                "free, and evicting the leaves that hold pages on the short lanes would not "
                "cover them (logged once; counted in capacity_refusals.%s)",
                "backup" if kind == "host_writes" else "load-back",
                node_id,
                lane_pages,
                lane_free,
                kind,
            )

    # ---------------------------------------------------------------- lifecycle
    def reset(self) -> None:
        # The controller's reset frees every host page, reserved or committed, at once.
        unclaimed = self.forward_reservations.unclaimed()
        self.pending_stats.rolled_back += len(self.pending_backups) + len(unclaimed)
        self.pending_backups.clear()
        self.forward_reservations.clear()
        super().reset()

    def reserved_host_tokens(self) -> int:
        """Logical host tokens reserved by backups not committed yet (not in the tree)."""
        records = [record.write for record in self.pending_backups.values()]
        records += [reservation.write for reservation in self.forward_reservations.unclaimed()]
        return sum(len(write.logical_host_locs) for write in records)

    # ----------------------------------------------------------------- storage
    def attach_storage_backend(self, *args, **kwargs):
        if self.uses_cp_hicache:
            raise CpSharedKVConfigError(
                f"{CLI_FLAG} does not support attaching a HiCache storage backend"
            )
        return super().attach_storage_backend(*args, **kwargs)

    # ----------------------------------------------------------------- metrics
    def cp_host_usage(self) -> dict:
        """Logical host tokens (identical on all ranks) and this rank's physical slots."""
        return self.cache_controller.host_usage()
