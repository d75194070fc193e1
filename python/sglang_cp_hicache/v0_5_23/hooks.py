"""The 0.5.23 line's hook table: every hook and resolution step the plugin puts into
SGLang 0.5.23.

Two kinds of seams, both named by path (nothing of this package is imported to describe
them):

* :data:`HOOKS`, ``HookRegistry`` hooks (``module:qualname`` targets), handed over by
  :mod:`sglang_cp_hicache.hook_table`: the flag on the CLI and on ``Engine(**kwargs)``,
  the DSA backend rule inside upstream's sharding gate (the Hopper formats), the startup
  self-test, per-layer D2H backup, L3 storage under sharding and lane-aware device eviction.
* :data:`RESOLUTION_STEPS`, wrappers of named steps of SGLang's resolution pipeline
  (``sglang.srt.arg_groups.resolution_hooks.register_resolution_hook``). 0.5.23 resolves
  server args there, not in ``ServerArgs.__post_init__``, so the flag's validation and its
  turning on of upstream's KV sharding are steps.

Registration is light (besides this package's registration modules it imports only
``resolution_hooks``, which itself imports nothing but ``typing``) and idempotent: SGLang
calls ``register`` in the launcher, the Engine and every scheduler, detokenizer and
DP-controller process, sometimes more than once per process. Imports nothing of this
package that imports it back (``server_args`` calls the check).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple

from sglang.srt.arg_groups import resolution_hooks

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.hook_table import HookSpec, PluginNotInstalledError, resolve

logger = logging.getLogger(__name__)

RELEASE = "0.5.23"

_SERVER_ARGS = "sglang.srt.server_args:ServerArgs"
_OURS_ARGS = "sglang_cp_hicache.v0_5_23.server_args"
_LANE_EVICTION = "sglang_cp_hicache.v0_5_23.mem_cache.lane_eviction"
_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
_LAYER_BACKUP = "sglang_cp_hicache.v0_5_23.mem_cache.layer_backup"
_EXTENSION = "sglang_cp_hicache.v0_5_23.mem_cache.cache_extension"

HOOKS: Tuple[HookSpec, ...] = (
    # The flag on the command line. from_cli_args copies only record fields, so the parsed
    # value (and the 0.5.12 spellings) would be dropped without the AROUND.
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", f"{_OURS_ARGS}:add_cli_args_after", "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", f"{_OURS_ARGS}:from_cli_args_around", "AROUND"),
    # Engine(enable_nsa_prefill_cp_shared_kv=True): ServerArgs is a msgspec struct whose
    # Python __init__ never runs, so the keyword is taken off where Engine builds the record.
    HookSpec(
        "sglang.srt.entrypoints.engine:Engine.__init__",
        f"{_OURS_ARGS}:engine_init_around",
        "AROUND",
    ),
    # Inside upstream's sharding gate, its DSA backend rule: under the flag, the Hopper
    # formats (flashmla_sparse bf16, flashmla_kv fp8) are admitted beside trtllm; every
    # other rule of the gate stays upstream's (arg_groups/kv_shard_hook.py).
    HookSpec(
        "sglang.srt.arg_groups.kv_shard_hook:validate_kv_shard_attention_backend",
        "sglang_cp_hicache.v0_5_23.arg_groups.kv_shard_hook:validate_dsa_backend_around",
        "AROUND",
    ),
    # One extension per sharded cache (v0_5_23/mem_cache/cache_extension.py): built with the
    # cache when the record's mode (cp_mode.py, settled by the resolution steps below)
    # shards KV, its host side and per-layer backup when HiCache is; every hook below finds
    # it, or calls upstream's function unchanged.
    HookSpec(f"{_URC}.__init__", f"{_EXTENSION}:cache_init_after", "AFTER"),
    HookSpec(
        f"{_URC}.init_hicache",
        "sglang_cp_hicache.v0_5_23.mem_cache.hicache_init:init_hicache_after",
        "AFTER",
    ),
    # Lane-aware device eviction (v0_5_23/mem_cache/lane_eviction.py): under the flag and
    # the sharded allocator, room is made only from victims on a short owner lane. The
    # extend's exact draws first, then the load-back's (and any caller's) evict_for_alloc,
    # and upstream's extra plain-LRU floor loop skipped; flag off: upstream's functions.
    HookSpec(
        "sglang.srt.mem_cache.allocation:alloc_paged_token_slots_extend",
        f"{_LANE_EVICTION}:alloc_paged_token_slots_extend_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.allocation:_kv_shard_rotation_bases",
        f"{_LANE_EVICTION}:kv_shard_rotation_bases_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.evict_for_alloc",
        f"{_LANE_EVICTION}:evict_for_alloc_around",
        "AROUND",
    ),
    # A plan's victims are evicted by upstream's own device walk, which takes its nodes
    # from the plan (and builds no heap of every leaf) while one is being evicted.
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.components.full:FullComponent._evict_device_start",
        f"{_LANE_EVICTION}:full_evict_device_start_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.components.full:FullComponent._evict_device_next_node",
        f"{_LANE_EVICTION}:full_evict_device_next_node_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common:_evict_until_allocatable",
        f"{_LANE_EVICTION}:evict_until_allocatable_around",
        "AROUND",
    ),
    # A load-back's room and gate are its exact per-owner draws (the host slots' owners).
    HookSpec(
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._load_back_transfers",
        f"{_LANE_EVICTION}:load_back_transfers_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.build_load_back_spec",
        f"{_LANE_EVICTION}:build_load_back_spec_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._component_available_size",
        f"{_LANE_EVICTION}:component_available_size_around",
        "AROUND",
    ),
    # Lane-aware host room for a backup (v0_5_23/mem_cache/host_lane_eviction.py): the
    # backup's exact host draws per owner lane, victims only on a short lane.
    HookSpec(
        f"{_URC}._execute_and_commit_kv_backup",
        "sglang_cp_hicache.v0_5_23.mem_cache.host_lane_eviction:execute_and_commit_kv_backup_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore.build_backup_spec",
        "sglang_cp_hicache.v0_5_23.mem_cache.host_lane_eviction:build_backup_spec_around",
        "AROUND",
    ),
    HookSpec(
        f"{_URC}.evict_host",
        "sglang_cp_hicache.v0_5_23.mem_cache.host_lane_eviction:evict_host_around",
        "AROUND",
    ),
    # The startup self-test (layers/attention/kv_shard_selftest.py): once the pool, shard
    # group and attention backends exist, before graphs and serving, the sharded read path
    # against the replicated one with the resolved backend's kernels; logs the scratch.
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner.init_attention_backends",
        "sglang_cp_hicache.v0_5_23.layers.attention.kv_shard_selftest:init_attention_backends_after",
        "AFTER",
    ),
    # L3 storage under the flag (docs/l3_storage.md): a sharded host pool gets the
    # owner-free file / Mooncake backends; any other backend is refused.
    HookSpec(
        "sglang.srt.mem_cache.storage.backend_factory:StorageBackendFactory.create_backend",
        "sglang_cp_hicache.v0_5_23.mem_cache.storage.backend_factory:create_backend_around",
        "AROUND",
    ),
    # L3: every CP rank writes what it owns (the MLA writer rule within attention TP).
    HookSpec(
        "sglang.srt.managers.cache_controller:HiCacheController._generate_storage_config",
        "sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller:generate_storage_config_around",
        "AROUND",
    ),
    # L3 backup: the owner writes its pages; a rank owning none does no I/O (still acked).
    HookSpec(
        "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController._page_backup",
        "sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller:page_backup_around",
        "AROUND",
    ),
    # L3 prefetch: each rank reads its owned pages; progress = its first missing owned page.
    HookSpec(
        "sglang.srt.managers.cache_controller:HiCacheController._page_transfer_kv_batch",
        "sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller:page_transfer_kv_batch_around",
        "AROUND",
    ),
    # L3 prefetch host slots: cyclic from a start owner decided from replicated state.
    HookSpec(
        "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController.alloc_prefetch_host_buffers",
        "sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller:alloc_prefetch_host_buffers_around",
        "AROUND",
    ),
    # L3 storage hit on a full host: lane-aware room for its slots' owner lanes.
    HookSpec(
        "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController.allocate_storage_hit",
        "sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller:allocate_storage_hit_around",
        "AROUND",
    ),
    # L3 prefetch anchor: never under a pending backup; the pages' start owner recorded.
    HookSpec(
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.prefetch_from_storage",
        "sglang_cp_hicache.v0_5_23.mem_cache.unified_radix_cache:prefetch_from_storage_around",
        "AROUND",
    ),
    # L3 prefetch result: the fetched host nodes get the rotation base their host slots follow.
    HookSpec(
        "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache._handle_prefetch_result",
        "sglang_cp_hicache.v0_5_23.mem_cache.unified_radix_cache:handle_prefetch_result_around",
        "AROUND",
    ),
    # L3 attached at runtime (admin API): file / mooncake as at startup, others refused.
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.storage_attachment:StorageAttachment.attach",
        "sglang_cp_hicache.v0_5_23.mem_cache.unified_cache.storage_attachment:attach_around",
        "AROUND",
    ),
    # Per-layer D2H backup under the flag (mem_cache/layer_backup.py): attached after HiCache
    # is built (the init_hicache hook, above); the insert takes the reserved host
    # slots; the ticket's ack finishes the node.
    HookSpec(f"{_URC}._execute_kv_backup", f"{_LAYER_BACKUP}:execute_kv_backup_around", "AROUND"),
    HookSpec(
        f"{_URC}._track_write_through_node", f"{_LAYER_BACKUP}:track_write_through_node_after", "AFTER"
    ),
    HookSpec(
        f"{_URC}._finish_write_through_ack", f"{_LAYER_BACKUP}:finish_write_through_ack_around", "AROUND"
    ),
    HookSpec(f"{_URC}.checkpoint", f"{_LAYER_BACKUP}:settle_after", "AFTER"),
    HookSpec(f"{_URC}.on_release", f"{_LAYER_BACKUP}:settle_after", "AFTER"),
    HookSpec(f"{_URC}.reset", f"{_LAYER_BACKUP}:reset_after", "AFTER"),
    # Each layer's KV store on the sharded pool (runs on every rank, zero-owned too).
    HookSpec(
        "sglang.srt.mem_cache.page_interleave_pool:PageInterleaveMLATokenToKVPool.set_mla_kv_buffer",
        f"{_LAYER_BACKUP}:store_kv_after",
        "AFTER",
    ),
    HookSpec(
        "sglang.srt.mem_cache.page_interleave_pool:PageInterleaveMLATokenToKVPool.set_kv_buffer",
        f"{_LAYER_BACKUP}:store_kv_after",
        "AFTER",
    ),
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner.forward",
        f"{_LAYER_BACKUP}:model_forward_around",
        "AROUND",
    ),
    # Host slots reserved before an extend forward.
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler.run_batch",
        f"{_LAYER_BACKUP}:run_batch_around",
        "AROUND",
    ),
    # PD prefill: an unreachable bootstrap server stops startup naming host:port.
    HookSpec(
        "sglang.srt.disaggregation.common.conn:CommonKVManager._register_topology_row",
        "sglang_cp_hicache.v0_5_23.disaggregation.common.conn:register_topology_row_around",
        "AROUND",
    ),
)


@dataclass(frozen=True)
class ResolutionStep:
    """One wrapper ``hook(server_args, previous)`` of the pipeline step named ``step``.

    ``step`` must be one of SGLang's overridable names; ``hook`` is a ``"module:qualname"``
    path, imported on the wrapper's first call.
    """

    step: str
    hook: str

    @property
    def label(self) -> str:
        """How the check names this step."""
        return f"resolution step {self.step}"


RESOLUTION_STEPS: Tuple[ResolutionStep, ...] = (
    # Runs before the model is resolved (and on the dummy-model path, which returns before
    # any model step): the configuration refusals, then enable_kv_cache_sharding declared
    # before its first reader (handle_gpu_memory_settings) and upstream's gate.
    ResolutionStep("validate_prefill_cp_platform", f"{_OURS_ARGS}:refuse_and_enable_sharding"),
    # Upstream's sharding gate, once the model is known: refuse a model outside the DSA
    # family, then run the gate unchanged.
    ResolutionStep("handle_kv_cache_sharding", f"{_OURS_ARGS}:refuse_unsupported_model"),
)

# Per step, the wrapper handed to register_resolution_hook: the check looks for this very
# object in SGLang's list, and a second registration finds it there.
_step_wrappers: Dict[ResolutionStep, Callable[[Any, Callable[[Any], None]], None]] = {}
_step_errors: Dict[ResolutionStep, str] = {}
_lock = threading.RLock()


def _lazy_wrapper(step: ResolutionStep) -> Callable[[Any, Callable[[Any], None]], None]:
    """A stand-in for ``step.hook`` that imports the real callable on its first call."""
    resolved: List[Callable[[Any, Callable[[Any], None]], None]] = []

    def run_step(server_args: Any, previous: Callable[[Any], None]) -> None:
        if not resolved:
            resolved.append(resolve(step.hook))
        resolved[0](server_args, previous)

    run_step.__qualname__ = run_step.__name__ = f"lazy[{step.hook}]"
    return run_step


def _registered(step: ResolutionStep, wrapper: Callable) -> bool:
    return any(fn is wrapper for fn in resolution_hooks._HOOKS.get(step.step, ()))


def install_resolution_steps(steps: Iterable[ResolutionStep]) -> None:
    """Register each of ``steps`` once per process; a step SGLang refuses (a name that is
    not overridable, e.g. renamed upstream) is logged and named by the check, never raised."""
    with _lock:
        for step in steps:
            wrapper = _step_wrappers.get(step)
            if wrapper is None:
                wrapper = _step_wrappers[step] = _lazy_wrapper(step)
            if _registered(step, wrapper):
                continue
            try:
                resolution_hooks.register_resolution_hook(step.step)(wrapper)
            except Exception as exc:
                _step_errors[step] = f"{type(exc).__name__}: {exc}"
                logger.exception("cp_hicache: cannot register the %s", step.label)


def register(source: Any = None) -> None:
    """Hand every hook of :data:`HOOKS` to SGLang (``source``: its ``HookSource``) and
    register every step of :data:`RESOLUTION_STEPS`."""
    hook_table.install(HOOKS, source=source)
    install_resolution_steps(RESOLUTION_STEPS)


def install(specs: Iterable[HookSpec], source: Any = None) -> None:
    """Register ``specs`` now or right after their target's import (see ``hook_table``)."""
    hook_table.install(specs, source=source)


def _why_step_missing(step: ResolutionStep, import_targets: bool) -> Optional[str]:
    if step in _step_errors:
        return _step_errors[step]
    wrapper = _step_wrappers.get(step)
    if wrapper is None:
        return "never registered in this process"
    if not _registered(step, wrapper):
        return "not in SGLang's wrappers of this step"
    if import_targets:
        try:  # the wrapper's first call must not be where a broken import shows up
            resolve(step.hook)
        except Exception as exc:
            return f"{step.hook}: {type(exc).__name__}: {exc}"
    return None


def missing_resolution_steps(
    steps: Iterable[ResolutionStep], *, import_targets: bool = True
) -> List[str]:
    """``"resolution step <name> (why)"`` for each of ``steps`` not in place."""
    missing = []
    for step in steps:
        why = _why_step_missing(step, import_targets)
        if why is not None:
            missing.append(f"{step.label} ({why})")
    return missing


def missing_hooks(
    specs: Optional[Iterable[HookSpec]] = None, *, import_targets: bool = True
) -> List[str]:
    """``"target (why)"`` for each spec not in place; by default every hook of
    :data:`HOOKS` and every step of :data:`RESOLUTION_STEPS`.

    ``import_targets=True`` imports every target module (``sglang.srt.entrypoints.engine``
    among them) and every hook callable; ``False`` imports nothing.
    """
    if specs is not None:
        return hook_table.missing_hooks(specs, import_targets=import_targets)
    return hook_table.missing_hooks(HOOKS, import_targets=import_targets) + (
        missing_resolution_steps(RESOLUTION_STEPS, import_targets=import_targets)
    )


def verify_hooks_installed(*, import_targets: bool = True) -> None:
    """Raise :class:`PluginNotInstalledError` naming every hook and step not in place."""
    hook_table.raise_if_missing(missing_hooks(import_targets=import_targets), RELEASE)


__all__ = [
    "HOOKS",
    "RESOLUTION_STEPS",
    "HookSpec",
    "PluginNotInstalledError",
    "RELEASE",
    "ResolutionStep",
    "install",
    "install_resolution_steps",
    "missing_hooks",
    "missing_resolution_steps",
    "register",
    "resolve",
    "verify_hooks_installed",
]
