"""The 0.5.12.post1 line's hook table: every hook the plugin puts into SGLang 0.5.12.post1.

Targets and hooks are named by ``module:qualname`` (nothing is imported to describe them);
:mod:`sglang_cp_hicache.hook_table` hands them to SGLang's ``HookRegistry``. Imports nothing
of this package that imports it back (``server_args`` and the KV mixin call the check).
"""

from __future__ import annotations

from typing import Any, Iterable, List, Optional, Tuple

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.hook_table import HookSpec, PluginNotInstalledError, resolve

RELEASE = "0.5.12.post1"

_SERVER_ARGS = "sglang.srt.server_args:ServerArgs"
_OURS_ARGS = "sglang_cp_hicache.v0_5_12.server_args"
_NSA_BACKEND = "sglang.srt.layers.attention.nsa_backend:NativeSparseAttnBackend"
_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer:Indexer"
_NSA_HOOKS = "sglang_cp_hicache.v0_5_12.layers.attention.nsa_backend_hooks"
_KV_MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"

HOOKS: Tuple[HookSpec, ...] = (
    # The flag, its carriage into ServerArgs, and validation.
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", f"{_OURS_ARGS}:add_cli_args_after", "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", f"{_OURS_ARGS}:from_cli_args_around", "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__init__", f"{_OURS_ARGS}:init_around", "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__post_init__", f"{_OURS_ARGS}:post_init_after", "AFTER"),
    HookSpec(
        f"{_SERVER_ARGS}.check_server_args",
        "sglang_cp_hicache.v0_5_12.launch_check:check_server_args_after",
        "AFTER",
    ),
    # Pools and allocation.
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin._init_pools",
        "sglang_cp_hicache.v0_5_12.model_executor.model_runner_kv_cache_mixin:init_pools_around",
        "AROUND",
    ),
    # The host mirror of req_to_token that CP HiCache plans backups from.
    HookSpec(
        "sglang.srt.mem_cache.common:alloc_for_extend",
        "sglang_cp_hicache.v0_5_12.mem_cache.common:alloc_for_extend_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common:alloc_for_decode",
        "sglang_cp_hicache.v0_5_12.mem_cache.common:alloc_for_decode_around",
        "AROUND",
    ),
    # alloc_for_extend's host snapshot of the batch's logical pages, carried to the forward
    # (the shared-KV page mapping then reads no req_to_token column back).
    HookSpec(
        "sglang.srt.managers.schedule_batch:ScheduleBatch.get_model_worker_batch",
        "sglang_cp_hicache.v0_5_12.managers.schedule_batch:get_model_worker_batch_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new",
        "sglang_cp_hicache.v0_5_12.model_executor.forward_batch_info:init_new_around",
        "AROUND",
    ),
    # Safe to replace: the scheduler imports HiRadixCache lazily, after hooks apply, and
    # the subclass is upstream HiRadixCache unless the allocator is the CP one.
    HookSpec(
        "sglang.srt.mem_cache.hiradix_cache:HiRadixCache",
        "sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache:CpHiRadixCache",
        "REPLACE",
    ),
    # The MTP draft's KV on host: the cache gets the draft pool when it is built (one host
    # object, one budget); upstream's MLA-only draft host pool registration is replaced.
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler.init_cache_with_memory_pool",
        "sglang_cp_hicache.v0_5_12.managers.scheduler:init_cache_with_memory_pool_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler._maybe_register_hicache_draft",
        "sglang_cp_hicache.v0_5_12.managers.scheduler:maybe_register_hicache_draft_around",
        "AROUND",
    ),
    # Prefill admission: a request that would split a pending host backup waits a round; a
    # batch never reads more KV pages than the dense buffers hold.
    HookSpec(
        "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req",
        "sglang_cp_hicache.v0_5_12.managers.schedule_policy:add_one_req_around",
        "AROUND",
    ),
    # Host pages of a prefill batch's new leaves reserved before its forward.
    HookSpec(
        "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_extend",
        "sglang_cp_hicache.v0_5_12.managers.schedule_batch:prepare_for_extend_after",
        "AFTER",
    ),
    # Shared-KV attention runtime: write translation, prefix materialisation.
    HookSpec(f"{_NSA_BACKEND}.init_forward_metadata", f"{_NSA_HOOKS}:init_forward_metadata_around", "AROUND"),
    HookSpec(f"{_NSA_BACKEND}.forward_extend", f"{_NSA_HOOKS}:forward_extend_around", "AROUND"),
    HookSpec(f"{_INDEXER}.forward_cuda", f"{_NSA_HOOKS}:indexer_forward_around", "AROUND"),
    HookSpec(f"{_INDEXER}._store_index_k_cache", f"{_NSA_HOOKS}:store_index_k_cache_around", "AROUND"),
    HookSpec(
        "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.forward",
        f"{_NSA_HOOKS}:model_forward_around",
        "AROUND",
    ),
    # The NSA MTP draft (DeepSeek-V3.2 and GLM-5 drafts are both this class) overrides
    # forward; its prefill extend materialises its one layer's prefix the same way.
    HookSpec(
        "sglang.srt.models.deepseek_nextn:DeepseekV3ForCausalLMNextN.forward",
        f"{_NSA_HOOKS}:model_forward_around",
        "AROUND",
    ),
    # Startup: the materialisation group and the read-path self-test, the dense-buffer
    # budget out of the KV pool, warm-up DECODE dummy runs.
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin.init_memory_pool",
        "sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest:init_memory_pool_around",
        "AROUND",
    ),
    HookSpec(
        f"{_KV_MIXIN}:ModelRunnerKVCacheMixin._profile_available_bytes",
        "sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget:profile_available_bytes_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner._dummy_run",
        f"{_NSA_HOOKS}:dummy_run_around",
        "AROUND",
    ),
    # PD transfer: each CP rank sends only the pages (and NSA state pages) it owns.
    HookSpec(
        "sglang.srt.disaggregation.utils:filter_kv_indices_for_cp_rank",
        "sglang_cp_hicache.v0_5_12.disaggregation.utils:filter_kv_indices_for_cp_rank_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.maybe_send_extra",
        "sglang_cp_hicache.v0_5_12.disaggregation.mooncake.conn:maybe_send_extra_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.send_kvcache_hisparse",
        "sglang_cp_hicache.v0_5_12.disaggregation.mooncake.conn:send_kvcache_hisparse_around",
        "AROUND",
    ),
    # PD prefill: an unreachable bootstrap server stops startup naming host:port.
    HookSpec(
        "sglang.srt.disaggregation.common.conn:CommonKVManager.register_to_bootstrap",
        "sglang_cp_hicache.v0_5_12.disaggregation.common.conn:register_to_bootstrap_around",
        "AROUND",
    ),
)


def register(source: Any = None) -> None:
    """Hand every hook of :data:`HOOKS` to SGLang (``source``: its ``HookSource``)."""
    hook_table.install(HOOKS, source=source)


def install(specs: Iterable[HookSpec], source: Any = None) -> None:
    """Register ``specs`` now or right after their target's import (see ``hook_table``)."""
    hook_table.install(specs, source=source)


def missing_hooks(
    specs: Optional[Iterable[HookSpec]] = None, *, import_targets: bool = True
) -> List[str]:
    """``"target (why)"`` for each spec (default: :data:`HOOKS`) whose hook is not in place."""
    return hook_table.missing_hooks(HOOKS if specs is None else specs, import_targets=import_targets)


def verify_hooks_installed(*, import_targets: bool = True) -> None:
    """Raise :class:`PluginNotInstalledError` naming every hook not in place."""
    hook_table.raise_if_missing(missing_hooks(import_targets=import_targets), RELEASE)


__all__ = [
    "HOOKS",
    "HookSpec",
    "PluginNotInstalledError",
    "RELEASE",
    "install",
    "missing_hooks",
    "register",
    "resolve",
    "verify_hooks_installed",
]
