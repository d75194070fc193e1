"""Per-layer D2H backup on SGLang 0.5.23's ``UnifiedRadixCache`` (plugin flag, sharded).

Upstream backs a node up at its insert, all layers at once, after the forward. Under the
plugin's flag, :class:`CacheLayerBackup` moves a prefill's new pages to host one layer at a
time *during* its forward, with the 0.5.12 line's contract and its shared pieces
(``core.ForwardReservations``, ``core.PerLayerBackup``, over ``l2_transfer``'s adapters):

* **Before the forward** (:meth:`reserve`, from the scheduler's ``run_batch``): host slots
  for the leaf the request's insert will create (its pages past ``cache_protected_len``),
  target and MTP draft tail layers alike (0.5.23 packs the draft in the same host slots);
  the write is held under a ticket (< -1) that rides in ``ongoing_write_through``, so the
  idle check and ``writing_check`` wait for it.
* **Each layer** (the pool's KV store hook): that layer's owned rows go to host on the D2H
  stream; the draft's after the draft layer. **One ack** per forward after the last layer,
  on every rank (a rank owning none of the pages records its events and acks too), in
  upstream's ``ack_write_queue``: the only sync stays ``writing_check``'s MIN all-reduce.
* **The insert** (``_execute_kv_backup``): a node over exactly a reserved leaf takes its
  host slots instead of a new all-layer write; upstream then commits and tracks it as its
  own pending write-through (device-locked, ``write_through_pending_id`` set), and a split
  of that pending node is upstream's own (``_replace_pending_write_through_node``).
* **The ack** (``_finish_write_through_ack`` of the ticket): the claiming node is finished,
  i.e. host-visible (unlocked, evictable to host, recorded as stored), only now; a
  reservation no node claimed (abort, retraction, insert miss) is rolled back, never before
  its ack since the copy may still write the slots.
* **Fail fast**: a forward that skips or reorders a layer, or ends with writes held, raises
  ``PerLayerBackupIncomplete``.

Flag off or unsharded: nothing is attached and every hook is upstream's path.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import numpy as np
import torch

from sglang_cp_hicache.core.forward_reservations import ForwardReservations, Next
from sglang_cp_hicache.core.per_layer_backup import PerLayerBackup, PerLayerBackupIncomplete
from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import (
    backup_with_lane_room,
    evict_host_for_backup,
    room_for_backup,
)
from sglang_cp_hicache.v0_5_23.backup.l2_transfer import (
    DeviceBackupStreams,
    L2LayerTransfers,
    MergedTransfer,
    ReservedWrite,
    backup_events_timed,
    per_layer_problem,
)

logger = logging.getLogger(__name__)


class PerLayerBackupUnavailable(RuntimeError):
    """The flag asks for per-layer backup and this stack cannot do it."""


class CacheLayerBackup:
    """One cache's forward reservations and per-layer pipeline (one per scheduler rank).

    Invariants: every reservation's ticket is in ``cache.ongoing_write_through`` from
    :meth:`reserve` until its ack pops; a node claimed before the ack is finished by that
    ack, one claimed after it at once; host slots return to the pool exactly once.
    """

    def __init__(self, cache: Any, layer_num: int, draft_layer_num: int, rank_label: str) -> None:
        controller = cache.cache_controller
        self.cache = cache
        self.page_size = cache.page_size
        self.lanes = cache.token_to_kv_pool_allocator.shard_size  # owner lanes of the rotation
        self.reservations: ForwardReservations[ReservedWrite, int] = ForwardReservations()
        timed = backup_events_timed(cache)  # decided once: upstream's metrics read the acks' times
        self.pipeline: PerLayerBackup[ReservedWrite, MergedTransfer] = PerLayerBackup(
            L2LayerTransfers(controller, timed),
            DeviceBackupStreams(controller, timed),
            layer_num=layer_num,
            draft_layer_num=draft_layer_num,
            rank_label=rank_label,
        )
        self._finish_on_track: Set[int] = set()  # claimed after their ack landed
        self._tokens: Dict[int, int] = {}  # ticket -> logical tokens, until its ack lands
        self.refused = 0  # reservations refused for want of host slots (upstream backs up at insert)

    # ---------------------------------------------------------------- before the forward
    def reserve(
        self, rid: str, device_locs: torch.Tensor, start_owner: Optional[int], stored_now: Optional[int] = None
    ) -> Optional[int]:
        """Reserve host slots for the leaf over the logical device slots ``device_locs``
        (page-aligned, the request's new pages) and hold its write for the next forward;
        returns the ticket, or None when the host cannot hold it (counted; the node is
        then backed up by upstream's all-layer write at its insert). ``stored_now``: how
        many of them the next forward stores (all when None; fewer when an earlier chunk
        stored the first page: :func:`backup_span`)."""
        self._settle(rid)
        if not len(device_locs):
            return None
        cache, cc = self.cache, self.cache.cache_controller
        sidecar = cache._build_backup_sidecar(device_locs, {})
        need = len(device_locs) - cc.mem_pool_host.available_size()
        if need > 0:  # room on short lanes only
            room = room_for_backup(cache, start_owner, len(device_locs), path="layer_backup")
            evict_host_for_backup(cache.evict_host, room, need)
        allocation = cc.allocate_host_transfers(device_locs, sidecar or None, start_owner=start_owner)
        if allocation is None:
            self.refused += 1
            logger.warning("request %s: no host slots for a per-layer backup of %d tokens", rid, len(device_locs))
            return None
        host_indices, pool_transfers = allocation
        write = ReservedWrite(0, host_indices, device_locs, pool_transfers or None)
        reservation = self.reservations.reserve(rid, write, self._pages(device_locs), per_layer=True)
        write.node_id = reservation.ticket
        cache.ongoing_write_through[write.node_id] = _ongoing(write.node_id)
        self._tokens[write.node_id] = len(device_locs) if stored_now is None else stored_now
        self.pipeline.hold(write)
        return write.node_id

    # ------------------------------------------------------------------ inside the forward
    def layer_stored(self, layer_id: int, num_locs: int) -> None:
        """Layer ``layer_id`` stored ``num_locs`` logical slots of the running forward.

        The layer is copied at its first store, so that store must cover every held
        slot: a layer stored in parts (two-batch overlap's micro-batches) would reach the
        host incomplete. Fails fast on a store smaller than the held writes (a length
        read, no device sync)."""
        held = self.pipeline.held_ack_ids
        if held:
            need = sum(self._tokens.get(ticket, 0) for ticket in held)
            if num_locs < need:
                self.pipeline.reset()
                raise PerLayerBackupIncomplete(
                    f"{self.pipeline.rank_label}: layer {layer_id} stored {num_locs} slots while "
                    f"per-layer backups of {need} are held (tickets {held}): a layer stored in "
                    "parts cannot be backed up at its first store"
                )
        self.pipeline.backup_layer(layer_id)

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        self.pipeline.end_forward(error)

    # ------------------------------------------------------------------------ the insert
    def claim(self, node_id: int, device_value: torch.Tensor) -> Optional[torch.Tensor]:
        """The insert backs up ``node_id`` over ``device_value``: its reserved host slots
        when a reservation covers exactly those pages, else None (upstream writes it)."""
        if not len(device_value) or not self.reservations.rids():
            return None  # nothing to claim: skip reading the pages (every insert's backup)
        transition = self.reservations.claim(node_id, self._pages(device_value))
        if transition is None:
            return None
        if transition.next is Next.COMMIT:  # the ack already landed: finish once tracked
            self._finish_on_track.add(node_id)
        return transition.reservation.write.host_indices

    def tracked(self, node_id: int) -> None:
        """Upstream tracks ``node_id``'s write-through: finish it now if its ack landed."""
        if node_id in self._finish_on_track:
            self._finish_on_track.discard(node_id)
            self.cache._finish_write_through_ack(node_id)

    def settle(self, rid: str) -> None:
        """``rid``'s insert is done or will not come (finish, abort, retraction)."""
        self._settle(rid)

    # --------------------------------------------------------------------------- the ack
    def land(self, ticket: int, finish_node: Callable[[int], None]) -> None:
        """The ack of ``ticket`` popped on every rank (after the MIN all-reduce)."""
        self.cache.ongoing_write_through.pop(ticket, None)
        self._tokens.pop(ticket, None)
        transition = self.reservations.land(ticket)
        if transition.next is Next.COMMIT:
            finish_node(transition.reservation.node)
        elif transition.next is Next.ROLL_BACK:
            self._roll_back(transition.reservation.write)

    def reset(self) -> None:
        """A flush: upstream cleared the host pools and ``ongoing_write_through``."""
        self.pipeline.reset()
        self.reservations.clear()
        self._finish_on_track.clear()
        self._tokens.clear()

    # -------------------------------------------------------------------------- internal
    def _settle(self, rid: str) -> None:
        transition = self.reservations.settle(rid)
        if transition is not None and transition.next is Next.ROLL_BACK:
            self._roll_back(transition.reservation.write)

    def _roll_back(self, write: ReservedWrite) -> None:
        group = self.cache.cache_controller.mem_pool_host
        group.free(write.host_indices)
        group.release_transfers(write.pool_transfers)

    def _pages(self, logical_locs: torch.Tensor) -> np.ndarray:
        return (logical_locs[:: self.page_size] // self.page_size).cpu().numpy()


def _ongoing(ticket: int) -> Any:
    """The ``ongoing_write_through`` entry a ticket rides in until its ack: no lock, no
    node to publish (upstream's own finish of it would be a no-op)."""
    from sglang.srt.mem_cache.unified_radix_cache import _OngoingWriteThrough

    return _OngoingWriteThrough(ticket, None, [])


# ---------------------------------------------------------------- the cache's extension
def layer_backup_of(cache: Any) -> Optional[CacheLayerBackup]:
    """The cache's per-layer backup, None when not attached (flag off, unsharded)."""
    extension = extension_of(cache)
    return None if extension is None else extension.layer_backup


def _listener_of(device_pool: Any) -> Any:
    """The backup stage ``device_pool``'s KV stores feed (its cache's extension's)."""
    extension = extension_of(device_pool)
    return None if extension is None else extension.listener_of(device_pool)


def attach(cache: Any, draft_layer_num: Optional[int] = None) -> CacheLayerBackup:
    """Give ``cache`` (HiCache initialised, sharded) per-layer backups; fail fast naming
    what this stack lacks."""
    cc, extension = cache.cache_controller, extension_of(cache)
    if cc is None or not getattr(cc, "is_kv_sharded", False) or extension is None:
        raise PerLayerBackupUnavailable("per-layer backup needs HiCache over upstream's KV sharding")
    problem = per_layer_problem(cc)
    if problem is not None:
        raise PerLayerBackupUnavailable(f"per-layer D2H backup is not available: {problem}")
    anchor = cc.mem_pool_host.anchor_entry
    device_pool = anchor.device_pool
    native_host = getattr(anchor.host_pool, "host_pool", anchor.host_pool)
    if draft_layer_num is None:
        draft_layer_num = getattr(native_host, "_draft_layer_num", 0)
    shard_rank = getattr(anchor.host_pool, "shard_rank", 0)
    backup = CacheLayerBackup(cache, device_pool.layer_num, draft_layer_num, f"CP rank {shard_rank}")
    listeners = [(device_pool, backup)] + [
        (draft_pool, backup.pipeline.draft_stage)
        for entry in cc.mem_pool_host.entry_map.values()
        for draft_pool in entry.packed_draft_device_pools
    ]
    extension.attach_layer_backup(backup, listeners)
    return backup


def notify_layer_stored(device_pool: Any, layer_id: int, num_locs: int) -> None:
    """Model layer ``layer_id``'s KV stores of ``num_locs`` logical slots on
    ``device_pool`` are issued (the target's pool checks they cover the held writes)."""
    listener = _listener_of(device_pool)
    if listener is None:
        return
    local_layer = layer_id - device_pool.start_layer
    if isinstance(listener, CacheLayerBackup):
        listener.layer_stored(local_layer, num_locs)
    else:  # the MTP draft stage: its forward stores the draft layer
        listener.backup_layer(local_layer)


def notify_forward_end(device_pool: Any, error: Optional[BaseException] = None) -> None:
    listener = _listener_of(device_pool)
    if listener is not None:
        listener.end_forward(error)


def backup_span(cache_protected_len: int, prefix_len: int, extend_end: int, page: int, bigram_keys: bool) -> Tuple[int, int, int]:
    """``(start, end, stored_now)``: the logical slots ``[start, end)`` of the leaf a
    request's insert after this forward creates, and how many of them this forward stores.

    The insert stops at the page floor of its radix key, which under EAGLE is a bigram key,
    one shorter than the tokens it spans (upstream's ``cache_unfinished_req``). So a chunked
    request's previous chunk left its last page out of the tree: that page starts this
    forward's leaf (``start`` below ``prefix_len``) though an earlier forward stored it
    (its rows are on the device already; the copy at this forward's layer stores reads them)."""
    end = (extend_end - int(bigram_keys)) // page * page
    return cache_protected_len, end, max(0, end - max(cache_protected_len, prefix_len))


def reserve_batch(cache: Any, reqs: List[Any]) -> Dict[str, int]:
    """Reserve, before an extend forward, host slots for the leaf each request's insert
    will create (:func:`backup_span`)."""
    backup = layer_backup_of(cache)
    if backup is None:
        return {}
    page = backup.page_size
    bigram_keys = bool(cache.tree_core.is_eagle)
    row_of = cache.req_to_token_pool.req_to_token
    tickets: Dict[str, int] = {}
    for req in reqs:
        start, end, stored_now = backup_span(req.kv.cache_protected_len, req.prefix_len, req.extend_end, page, bigram_keys)
        if req.kv.req_pool_idx is None or end <= start:
            continue
        locs = row_of[req.kv.req_pool_idx, start:end].to(torch.int64)
        base = req.kv_rotation_base
        owner = None if base is None else owner_of(base, start // page, backup.lanes)
        ticket = backup.reserve(req.rid, locs, owner, stored_now)
        if ticket is not None:
            tickets[req.rid] = ticket
    return tickets


# --------------------------------------------------------------------------------- hooks
def set_up(cache: Any, server_args: Any) -> None:
    """Once HiCache is initialised (``hicache_init.init_hicache_after``), for a cache with
    an extension (the sharded mode): per-layer backups. Two-batch overlap (a layer stored
    in two parts) and host pools without a one-layer D2H path (``per_layer_problem``) are
    refused here, at start-up."""
    if extension_of(cache) is None or cache.cache_controller is None:
        return
    if getattr(server_args, "enable_two_batch_overlap", False):
        raise PerLayerBackupUnavailable(
            "--enable-nsa-prefill-cp-shared-kv backs up each layer at its store; two-batch "
            "overlap stores a layer in two parts: drop --enable-two-batch-overlap"
        )
    attach(cache)


def execute_kv_backup_around(original: Callable, cache: Any, node_id, device_value, comp_xfers, sidecar_xfers):
    """``UnifiedRadixCache._execute_kv_backup``: the reserved host slots when the insert's
    node claims them; else upstream's backup, its host room the node's exact lane draws
    (the eviction room's ``backup_with_lane_room``: one AROUND on the target for both)."""
    backup = layer_backup_of(cache)
    if backup is not None and not comp_xfers:
        host_indices = backup.claim(node_id, device_value)
        if host_indices is not None:
            return host_indices
    return backup_with_lane_room(original, cache, node_id, device_value, comp_xfers, sidecar_xfers)


def track_write_through_node_after(result: Any, cache: Any, node_id, *args, **kwargs) -> None:
    backup = layer_backup_of(cache)
    if backup is not None:
        backup.tracked(node_id)


def finish_write_through_ack_around(original: Callable, cache: Any, ack_id: int) -> None:
    backup = layer_backup_of(cache)
    if backup is not None and backup.reservations.in_flight(ack_id):
        backup.land(ack_id, lambda node_id: original(cache, node_id))
        return
    original(cache, ack_id)


def settle_after(result: Any, cache: Any, req: Any, *args, **kwargs) -> None:
    """After ``checkpoint`` (the insert) and ``on_release`` (finish, abort, retraction)."""
    backup = layer_backup_of(cache)
    if backup is not None:
        backup.settle(req.rid)


def reset_after(result: Any, cache: Any) -> None:
    backup = layer_backup_of(cache)
    if backup is not None:
        backup.reset()


def store_kv_after(
    result: Any, pool: Any, layer: Any, loc_info: Any, *args, layer_id_override=None, **kwargs
) -> None:
    """After ``PageInterleaveMLATokenToKVPool.set_mla_kv_buffer``/``set_kv_buffer``: the
    sharded pool's own method runs on every rank, also one owning none of the rows."""
    if _listener_of(pool) is not None:
        from sglang.srt.mem_cache.memory_pool import unwrap_write_loc

        layer_id = layer_id_override if layer_id_override is not None else layer.layer_id
        notify_layer_stored(pool, layer_id, unwrap_write_loc(loc_info)[0].numel())


def model_forward_around(original: Callable, runner: Any, forward_batch: Any, *args, **kwargs):
    """The forward's end for the runner's pool (the target's, or the MTP draft runner's):
    0.5.23's ``ForwardBatch`` carries no pool, the ``ModelRunner`` does."""
    pool = runner.token_to_kv_pool
    try:
        output = original(runner, forward_batch, *args, **kwargs)
    except BaseException as error:
        notify_forward_end(pool, error)
        raise
    notify_forward_end(pool)
    return output


def run_batch_around(original: Callable, scheduler: Any, batch: Any, *args, **kwargs):
    if batch is not None and batch.forward_mode.is_extend():
        reserve_batch(scheduler.tree_cache, batch.reqs)
    return original(scheduler, batch, *args, **kwargs)


__all__ = [
    "CacheLayerBackup",
    "PerLayerBackupUnavailable",
    "attach",
    "backup_span",
    "layer_backup_of",
    "notify_forward_end",
    "notify_layer_stored",
    "reserve_batch",
]
