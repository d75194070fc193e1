"""The simulator's view into one 0.5.23 rank's real cache stack: wrappers that observe,
never decide.

``testing.v0_5_23.stack`` builds ``UnifiedRadixCache`` itself (no cache class to pass), so
the observation points are instance wrappers of the stack's own seams; each calls the
wrapped method unchanged, before or after counting:

* ``evict`` / ``evict_for_alloc`` / ``evict_host``: timed as the scheduler op ``evict``
  wherever the scheduler path calls them; ``init_load_back`` timed as ``load_back``;
* ``_sync_hicache_ready_counts`` / ``writing_check`` / ``loading_check``: upstream's own MIN
  all-reduces of ready acks, the only collectives allowed on the scheduler path;
* ``_execute_kv_backup``: backups skipped for want of host room (it returns None);
* ``insert``: inserts the tree declines (``rotation_tail_declined``: the key would join two
  rotation runs, ``unified_tree_core.py:1158-1229``);
* the tree core's KV-event recorder (``record_remove``, called on every device and host
  eviction whether or not events are published): evicted nodes and tokens;
* the controller's ``start_writing`` / ``start_loading``: logical tokens of every D2H and
  H2D operation, and (loads) the owned rows poisoned before the copy runs;
* the L2 engine's ``submit_device_to_host`` / ``submit_host_to_device``: this rank's
  physical rows of the KV anchor pool, i.e. what it really moves;
* per-layer D2H backup (:meth:`CacheObserver.attach_layer_backup`): its reservations
  (timed as ``insert``, logical tokens) and the anchor host pool's one-layer D2H op
  (physical rows).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, List, Tuple

import torch

from sglang_cp_hicache.sim.results import RankCounters


@dataclass(frozen=True)
class DeclinedInsert:
    """One insert the tree refused: its key's tokens and the prefix it matched."""

    token_ids: Tuple[int, ...]
    matched_len: int

    @property
    def rejected_tokens(self) -> int:
        return len(self.token_ids) - self.matched_len


@dataclass
class CacheObserver:
    """Where one rank's observations go. ``attach`` installs the wrappers on ``stack``."""

    counters: RankCounters
    timed_op: Callable[[str], ContextManager]  # the driver's timer of scheduler ops
    allowed_collective: Callable[[], ContextManager]  # marks upstream's MIN all-reduces
    before_load: Callable[[torch.Tensor], None]  # logical device locs about to be loaded
    d2h_tokens: int = 0  # physical rows this rank backed up (KV anchor pool)
    h2d_tokens: int = 0
    declined: List[DeclinedInsert] = field(default_factory=list)

    def attach(self, stack: Any) -> None:
        cache, controller = stack.cache, stack.controller
        for name in ("evict", "evict_for_alloc", "evict_host"):
            _wrap(cache, name, self._timed("evict"))
        _wrap(cache, "init_load_back", self._timed("load_back"))
        for name in ("_sync_hicache_ready_counts", "writing_check", "loading_check"):
            _wrap(cache, name, self._allowed)
        _wrap(cache, "insert", self._insert)
        _wrap(cache, "_execute_kv_backup", self._backup)
        _wrap(cache.tree_core.kv_events, "record_remove", self._record_remove)
        _wrap(controller, "start_writing", self._start_writing)
        _wrap(controller, "start_loading", self._start_loading)
        anchor = stack.host_pool_group.anchor_entry.host_pool
        engine = controller.l2_transfer_engine
        _wrap(engine, "submit_device_to_host", self._physical("d2h_tokens", anchor))
        _wrap(engine, "submit_host_to_device", self._physical("h2d_tokens", anchor))

    def attach_layer_backup(self, backup: Any, stack: Any) -> None:
        """Per-layer D2H backup: its reservations timed as ``insert`` and counted as written
        (logical), the one-layer D2H copies of the KV anchor pool counted as this rank's
        physical rows (once per backup, at layer 0). A reservation is the insert's backup
        made before the forward: the host slots upstream's insert takes in
        ``_execute_kv_backup`` (timed there as ``insert`` in every column), so the plugin's
        and native's host-side backup work fall in the same operation."""
        _wrap(backup, "reserve", self._reserve)
        anchor = stack.host_pool_group.anchor_entry.host_pool
        native = getattr(anchor, "host_pool", anchor)  # PageInterleaveHostPool wraps one
        _wrap(native, "_backup_from_device_per_layer", self._layer_copy)

    def take_declined(self) -> List[DeclinedInsert]:
        taken, self.declined = self.declined, []
        return taken

    # ------------------------------------------------------------------ wrappers
    def _timed(self, op: str) -> Callable:
        def around(original: Callable, *args, **kwargs):
            with self.timed_op(op):
                return original(*args, **kwargs)

        return around

    def _allowed(self, original: Callable, *args, **kwargs):
        with self.allowed_collective():
            return original(*args, **kwargs)

    def _insert(self, original: Callable, params, *args, **kwargs):
        result = original(params, *args, **kwargs)
        if getattr(result, "rotation_tail_declined", False):
            tokens = tuple(int(t) for t in params.key.raw_token_ids())
            self.declined.append(DeclinedInsert(tokens, int(result.prefix_len)))
        return result

    def _backup(self, original: Callable, *args, **kwargs):
        host_indices = original(*args, **kwargs)
        if host_indices is None:  # no host room: upstream skips the backup
            self.counters.backups_skipped_host_full += 1
        return host_indices

    def _record_remove(self, original: Callable, node, medium=None):
        from sglang.srt.disaggregation.kv_events import StorageMedium
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        counters = self.counters
        full = node.component_data[ComponentType.FULL]
        tokens = len(node.key)
        if medium == StorageMedium.CPU:
            counters.host_evicted_nodes += 1
            counters.host_evicted_tokens += tokens
        else:  # demoted to host-only, or dropped (never backed up)
            counters.device_evicted_nodes += 1
            counters.device_evicted_tokens += tokens
            if full.host_value is None:
                counters.device_dropped_tokens += tokens
        return original(node, medium=medium)

    def _start_writing(self, original: Callable, *args, **kwargs):
        controller = original.__self__
        queued = sum(len(op.device_indices) for op in controller.write_queue)
        self.counters.logical_written_tokens += queued
        return original(*args, **kwargs)

    def _start_loading(self, original: Callable, *args, **kwargs):
        controller = original.__self__
        for op in controller.load_queue:
            self.counters.logical_loaded_tokens += len(op.device_indices)
            self.before_load(op.device_indices)
        return original(*args, **kwargs)

    def _reserve(self, original: Callable, rid, device_locs, *args, **kwargs):
        with self.timed_op("insert"):
            ticket = original(rid, device_locs, *args, **kwargs)
        if ticket is not None:
            self.counters.logical_written_tokens += len(device_locs)
        return ticket

    def _layer_copy(self, original: Callable, host_indices, device_indices, layer_id, *args, is_draft=False, **kwargs):
        if layer_id == 0 and not is_draft:
            self.d2h_tokens += len(host_indices)
        return original(host_indices, device_indices, layer_id, *args, is_draft=is_draft, **kwargs)

    def _physical(self, attr: str, anchor: Any) -> Callable:
        def around(original: Callable, transfers, *args, **kwargs):
            ours = (t for t in transfers if t.host_pool is anchor and not t.is_draft)
            rows = sum(len(t.host_indices) for t in ours)
            setattr(self, attr, getattr(self, attr) + rows)
            return original(transfers, *args, **kwargs)

        return around


def _wrap(owner: Any, name: str, around: Callable) -> None:
    """Replace ``owner.name`` on the instance by ``around(original, *args, **kwargs)``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)

    setattr(owner, name, wrapped)


__all__ = ["CacheObserver", "DeclinedInsert"]
