"""One rank's REAL SGLang 0.5.23 DSA HiCache stack, built on CPU.

What a scheduler rank of a PD-prefill worker with ``--enable-kv-cache-sharding`` holds, built
directly (as upstream's own kit does, ``sglang/test/kits/unified_radix_cache/fixtures.py``)
instead of through ``KVCacheConfigurator``:

* sharded (``shard_size > 1``, one :func:`~sglang_cp_hicache.testing.dist.run_ranks` rank
  each): ``PageInterleaveDSATokenToKVPool`` over a gloo shard group,
  ``PageInterleavePoolAllocator`` (the logical index space, ``shard_size`` x one rank's
  rows), and after ``init_hicache`` a ``HybridCacheController`` whose KV host pool is a
  ``PageInterleaveHostPool``;
* unsharded (the replicated reference): ``DSATokenToKVPool``,
  ``PagedTokenToKVPoolAllocator`` and plain host pools.

``StackConfig.mtp_draft`` adds the EAGLE MTP draft's device pool (one NextN layer) as a
PD prefill worker builds it: sharded, a ``PageInterleaveDSATokenToKVPool`` with the target's
shard spec and group and its own buffers (``_build_mtp_kv_shard_pool``,
``kv_cache_configurator.py:1922``); unsharded, a one-layer ``DSATokenToKVPool``. It is
handed to ``init_hicache`` as ``CacheInitParams.mtp_draft_device_pools`` (what
``_build_hicache_draft_plan``'s PACKED mode sets), so upstream packs the draft's latent KV
and indexer as the tail host layer of the target's host pools, in the same host slots.

Both share ``ReqToTokenPool`` and ``UnifiedRadixCache`` with the Python tree core (the only
core sharding accepts). The radix tree, allocator and ``req_to_token`` are logical and
identical on every rank; the device and host pools are physical, per rank. Call
:func:`~sglang_cp_hicache.testing.install` before SGLang is imported (``run_ranks`` ranks
and the root ``conftest.py`` do).

The stack's types (:class:`StackConfig`, :class:`RankStack`, :class:`TreeNodeView`) live in
:mod:`~sglang_cp_hicache.testing.v0_5_23.rank_stack`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.dist import RankContext
from sglang_cp_hicache.testing.v0_5_23.rank_stack import (
    RankStack,
    StackConfig,
)
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup


def publish_server_args(
    config: StackConfig, sharded: bool, storage_backend: Optional[str] = None, **fields: Any
) -> Any:
    """The process's ServerArgs, published the way the cache reads its config (publishing
    resolves it). ``storage_backend``: HiCache with that L3 backend; with
    ``config.cp_shared_kv`` on an unsharded stack it is the flag's one-prefill-rank mode
    (a ``--tp 1`` server with the owner-free L3 keys), the only unsharded use of the flag.
    ``fields``: further ``ServerArgs`` fields (a PD server's)."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    flag_fields = (
        dict(enable_prefill_cp=True, cp_strategy="interleave", disaggregation_mode="prefill")
        if config.cp_shared_kv
        else {}
    )
    if storage_backend is not None:
        flag_fields.update(enable_hierarchical_cache=True, hicache_storage_backend=storage_backend)
    flag_fields.update(fields)
    server_args = ServerArgs(
        model_path="dummy",
        page_size=config.page_size,
        context_length=config.context_len,
        chunked_prefill_size=config.chunk_tokens,
        hicache_ratio=config.host_to_device_ratio,
        hicache_io_backend=config.io_backend,
        hicache_mem_layout=config.mem_layout,
        hicache_write_policy=config.write_policy,
        hicache_host_memory_mode="cache",
        enable_kv_cache_sharding=sharded,
        **flag_fields,
    )
    if config.cp_shared_kv:
        if not sharded and storage_backend is None:
            raise ValueError(
                "StackConfig.cp_shared_kv needs a sharded stack (unsharded: only with an L3 "
                "backend, the flag on one prefill rank)"
            )
        from sglang_cp_hicache.v0_5_23.launch.flag import set_cp_shared_kv_enabled

        set_cp_shared_kv_enabled(server_args, True)  # publishing resolves the record
    set_global_server_args_for_scheduler(server_args)
    return server_args


def _dsa_pool_kwargs(config: StackConfig, layer_num: Optional[int] = None) -> dict:
    """A DSA device pool's geometry: the target's, or ``layer_num`` layers (the draft)."""
    kwargs = dict(
        page_size=config.page_size,
        kv_lora_rank=config.kv_lora_rank,
        dtype=config.dtype,
        qk_rope_head_dim=config.qk_rope_head_dim,
        layer_num=config.layer_num if layer_num is None else layer_num,
        device=config.device,
        index_head_dim=config.index_head_dim,
        enable_memory_saver=False,
        kv_cache_dim=config.kv_cache_dim,
    )
    if layer_num is None and config.skip_topk_layers is not None:  # the draft's one layer has its own
        kwargs["skip_topk_layers"] = list(config.skip_topk_layers)
    return kwargs


def _build_cache(
    config: StackConfig,
    server_args: Any,
    allocator: Any,
    req_to_token_pool: Any,
    groups: dict,
    draft_kv_pool: Any = None,
) -> tuple[Any, Any]:
    """UnifiedRadixCache (Python core, FULL component) with HiCache initialised; a draft
    pool is packed into the host pools as upstream's PACKED draft plan does."""
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    params = CacheInitParams(
        disable=False,
        req_to_token_pool=req_to_token_pool,
        token_to_kv_pool_allocator=allocator,
        page_size=config.page_size,
        tree_components=(ComponentType.FULL,),
        mtp_draft_device_pools=() if draft_kv_pool is None else (draft_kv_pool,),
        enable_metrics=config.enable_metrics,
        # upstream's scheduler: pp, attention-TP and attention-CP rank 0 only
        enable_kv_cache_events=config.kv_events and groups.get("attn_cp_rank", 0) == 0,
        **groups,
    )
    # Sharding forces the Python core (kv_shard_hook.py:132-144); so does the reference.
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"):
        cache = UnifiedRadixCache(params=params)
    cache.init_hicache(server_args, params)
    return cache, params


def _req_to_token_pool(config: StackConfig) -> Any:
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    return ReqToTokenPool(
        size=config.max_num_reqs, max_context_len=config.context_len, device=config.device,
        enable_memory_saver=False,
    )  # fmt: skip


def build_sharded_stack(ctx: RankContext, config: StackConfig = StackConfig()) -> RankStack:
    """Rank ``ctx.rank``'s sharded stack; every rank of ``ctx.cp_group`` must call it.

    The shard group is the CP group (upstream's ``get_kv_shard_group`` under prefill CP);
    the pool's gather communicator is gloo (the runtime rebinds ``PyNcclCommunicator``).
    """
    from sglang.srt.mem_cache.page_interleave import PageInterleavePlacement, PageShardSpec

    shard_group = GlooShardGroup.from_rank_context(ctx)
    shard_group = dataclasses.replace(shard_group, device=torch.device(config.device))
    if shard_group.world_size < 2:
        raise ValueError("build_sharded_stack needs a shard group of at least 2 ranks")
    server_args = publish_server_args(config, sharded=True)
    spec = PageShardSpec(
        shard_rank=shard_group.rank_in_group,
        shard_size=shard_group.world_size,
        page_size=config.page_size,
        max_prefix_tokens=config.scratch_prefix_tokens(shard_group.world_size),
        chunk_tokens=config.chunk_tokens,
    )
    kv_pool, draft_kv_pool, allocator = _sharded_pools(config, spec, shard_group)
    req_to_token_pool = _req_to_token_pool(config)
    groups = dict(
        tp_cache_group=ctx.attn_tp_group,
        attn_cp_cache_group=ctx.cp_group,
        attn_tp_cache_group=ctx.attn_tp_group,
        attn_cp_rank=spec.shard_rank,
        attn_cp_size=spec.shard_size,
    )
    cache, params = _build_cache(
        config, server_args, allocator, req_to_token_pool, groups, draft_kv_pool
    )
    return RankStack(
        config=config,
        shard_rank=spec.shard_rank,
        shard_size=spec.shard_size,
        server_args=server_args,
        kv_pool=kv_pool,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        cache=cache,
        params=params,
        shard_group=shard_group,
        placement=PageInterleavePlacement(spec),
        draft_kv_pool=draft_kv_pool,
    )


def _sharded_pools(config: StackConfig, spec: Any, shard_group: GlooShardGroup) -> Tuple[Any, Any, Any]:
    """One rank's sharded KV pool, the MTP draft's beside it (upstream's
    ``_build_mtp_kv_shard_pool``: the target's spec and group; None without the draft) and
    the logical allocator over them."""
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

    kv_pool = PageInterleaveDSATokenToKVPool(
        config.device_rows_per_rank,
        shard_spec=spec,
        shard_group=shard_group,
        **_dsa_pool_kwargs(config),
    )
    draft_kv_pool = None
    if config.mtp_draft:
        draft_kv_pool = PageInterleaveDSATokenToKVPool(
            kv_pool.size,
            shard_spec=kv_pool.shard_spec,
            shard_group=kv_pool.shard_group,
            index_kpool=1,
            **_dsa_pool_kwargs(config, layer_num=config.draft_layer_num),
        )
    allocator = PageInterleavePoolAllocator(
        config.device_rows_per_rank,
        physical_page_size=config.page_size,
        shard_size=spec.shard_size,
        dtype=config.dtype,
        device=config.device,
        kvcache=kv_pool,
        need_sort=True,  # PD prefill workers sort (kv_cache_configurator need_sort)
        shard_spec=spec,
    )
    return kv_pool, draft_kv_pool, allocator


_hooks_applied: List[bool] = []  # once per process: a second apply would wrap the targets again


def apply_plugin_hooks() -> None:
    """Register the 0.5.23 line's hooks and apply them in this process (a rank), once;
    raises naming any hook not in place."""
    if _hooks_applied:
        return
    from sglang.srt.plugins.hook_registry import HookRegistry

    from sglang_cp_hicache.plugin import register
    from sglang_cp_hicache.v0_5_23.hooks import missing_hooks

    register()
    HookRegistry.apply_hooks()
    missing = missing_hooks()
    if missing:
        raise RuntimeError(f"plugin hooks not in place: {missing}")
    _hooks_applied.append(True)


@contextlib.contextmanager
def sharded_stack(
    ctx: RankContext, config: StackConfig = StackConfig(), *, plugin_hooks: bool = True
) -> Iterator[RankStack]:
    """A multi-rank test's stack: the plugin's hooks applied in this rank (unless
    ``plugin_hooks`` is False: upstream alone), then :func:`build_sharded_stack`. On exit,
    also on error, it closes what it opened: the stack (host pools, the cache's atexit
    hook) and the runtime context it published (server args), restored as found."""
    from sglang.srt.runtime_context import restore_context, snapshot_context

    if plugin_hooks:
        apply_plugin_hooks()
    before = snapshot_context()
    try:
        with build_sharded_stack(ctx, config) as stack:
            yield stack
    finally:
        restore_context(before)


def build_unsharded_stack(tp_group: Any, config: StackConfig = StackConfig()) -> RankStack:
    """The replicated reference: one rank holding every page (``tp_group``: its cache's
    TP group, e.g. :func:`~sglang_cp_hicache.testing.dist.single_rank_world`)."""
    from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

    server_args = publish_server_args(config, sharded=False)
    kv_pool = DSATokenToKVPool(config.device_rows_per_rank, **_dsa_pool_kwargs(config))
    draft_kv_pool = None
    if config.mtp_draft:
        draft_kv_pool = DSATokenToKVPool(
            config.device_rows_per_rank, **_dsa_pool_kwargs(config, config.draft_layer_num)
        )
    allocator = PagedTokenToKVPoolAllocator(
        config.device_rows_per_rank,
        page_size=config.page_size,
        dtype=config.dtype,
        device=config.device,
        kvcache=kv_pool,
        need_sort=True,
    )
    req_to_token_pool = _req_to_token_pool(config)
    cache, params = _build_cache(
        config, server_args, allocator, req_to_token_pool, dict(tp_cache_group=tp_group),
        draft_kv_pool,
    )
    return RankStack(
        config=config,
        shard_rank=0,
        shard_size=1,
        server_args=server_args,
        kv_pool=kv_pool,
        allocator=allocator,
        req_to_token_pool=req_to_token_pool,
        cache=cache,
        params=params,
        draft_kv_pool=draft_kv_pool,
    )


__all__ = [
    "apply_plugin_hooks",
    "build_sharded_stack",
    "build_unsharded_stack",
    "publish_server_args",
    "sharded_stack",
]
