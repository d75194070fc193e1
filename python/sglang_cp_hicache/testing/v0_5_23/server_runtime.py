"""The 0.5.23 line's CPU server runtime: the steps that let SGLang 0.5.23's own
``launch_server`` processes serve the tiny DSA model on a CPU-only box (test-only; applied by
the serving harness through :mod:`sglang_cp_hicache.testing.server.runtime`).

Every step is a post-import patch (the project's import watcher) or an environment knob set
before SGLang is imported; none touches the plugin. Both servers of a comparison (sharded
and unsharded) run the same steps, so identical tokens prove the sharding, translation,
HiCache and PD paths consistent with the unsharded server, not the GPU kernels (the startup
self-test and the GPU checks cover those).
"""

from __future__ import annotations

import logging
import os
import sys
import types
from typing import Any, Callable, Optional, Tuple

from sglang_cp_hicache.core.import_watcher import process_watcher
from sglang_cp_hicache.testing.server import common_steps, dsa_kernels
from sglang_cp_hicache.testing.server.launch import L3_PUTS_LOGGED_ENV, UNSHARDED_CP_L3_WRITERS_ENV
from sglang_cp_hicache.testing.server.runtime import RuntimeStep

logger = logging.getLogger(__name__)

DSA_INDEXER = "sglang.srt.layers.attention.dsa.dsa_indexer"
DSA_BACKEND = "sglang.srt.layers.attention.dsa_backend"
DSA_MTP_PRECOMPUTE = "sglang.srt.layers.attention.dsa.dsa_backend_mtp_precompute"
ALLOCATION = "sglang.srt.mem_cache.allocation"
KV_SHARD_GATE = "sglang.srt.arg_groups.kv_shard_hook"

ENVIRONMENT = {
    "SGLANG_USE_CPU_ENGINE": "1",  # `--device cpu` alone is not SGLang's CPU mode
    "TORCHDYNAMO_DISABLE": "1",  # torch.compile'd helpers run eagerly (no inductor build)
    # Upstream's torch top-k backend has no fused transform (dsa_topk_backend.py:269).
    "SGLANG_DSA_FUSE_TOPK": "0",
    # A crashed scheduler dies at once instead of waiting for a CUDA core dump.
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0",
}

#: ``sgl_kernel`` names 0.5.23's CPU engine imports at module level (EAGLE's get torch
#: bodies from :mod:`~sglang_cp_hicache.testing.server.spec_kernels`; the others raise).
SGL_KERNEL_IMPORTED: Tuple[str, ...] = (
    "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu",
    "build_tree_kernel_efficient_cpu",
    "copy_all_layer_kv_cache_cpu",
    "fill_accept_out_cache_loc_cpu",
    "fill_bonus_tokens_cpu",
    "verify_tree_greedy_cpu",
)


def _sgl_kernel() -> None:
    from sglang_cp_hicache.testing.server import sgl_kernel_stand_in

    sgl_kernel_stand_in.install(SGL_KERNEL_IMPORTED)


def _eagle_kernels() -> None:
    from sglang_cp_hicache.testing.server import sgl_kernel_stand_in, spec_kernels

    sgl_kernel_stand_in.add_bodies(spec_kernels.EAGLE_BODIES)


def _project_runtime() -> None:
    from sglang_cp_hicache.testing import install

    install()


def _read_path() -> None:
    from sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference import quantize_k_cache_separate_reference
    from sglang_cp_hicache.testing.v0_5_23.read_path import kernels

    watcher = process_watcher()

    def dsa_backend(module: Any) -> None:
        module.transform_index_page_table_prefill = kernels.transform_index_page_table_prefill_reference
        module.transform_index_page_table_decode = dsa_kernels.transform_index_page_table_decode

    def get_k_and_s(module: Any) -> None:
        module.GetKAndS.triton = classmethod(kernels.get_k_and_s_reference)

    def quantize(module: Any) -> None:
        module.quantize_k_cache_separate = quantize_k_cache_separate_reference

    def cp_split(module: Any) -> None:
        module.dsa_cp_interleave_q_seqs = kernels.dsa_cp_interleave_q_seqs_reference

    # The interface module imports the CUDA-only flash_mla package: it cannot import on a
    # CPU, so a module holding only the stand-ins takes its name.
    flash_mla = types.ModuleType(kernels.CpuKernelStandIns.FLASH_MLA_INTERFACE)
    for name, stand_in in kernels.CpuKernelStandIns.FLASH_MLA_STAND_INS.items():
        setattr(flash_mla, name, stand_in)
    sys.modules[flash_mla.__name__] = flash_mla
    watcher.when_imported(DSA_BACKEND, dsa_backend)
    watcher.when_imported("sglang.kernels.ops.kvcache.dsa_index_k_cache", get_k_and_s)
    watcher.when_imported("sglang.srt.mem_cache.memory_pool", quantize)
    watcher.when_imported("sglang.kernels.ops.attention.dsa.cp_split", cp_split)


# ---------------------------------------------------------------------------- indexer
def indexer_forward_native(
    self: Any,
    x: Any,
    q_lora: Any,
    positions: Any,
    forward_batch: Any,
    layer_id: int,
    return_indices: bool = True,
    use_cuda_graph: bool = True,
) -> Optional[Any]:
    """``Indexer.forward_cuda``'s eager, unfused path with the kernels in torch: upstream's
    own q/k projection, rope, rotation, CP key gather, K-cache store, head gates, masks and
    top-k transform; :mod:`~sglang_cp_hicache.testing.server.dsa_kernels` for act_quant and
    the fp8 MQA logits (ragged for an extend, paged for a decode)."""
    import torch

    from sglang.srt.layers.attention.dsa import dsa_indexer as m

    if self.use_dsa_indexer_fusion:
        raise NotImplementedError("CPU indexer: the fused indexer path has no torch port")
    metadata = m.get_attn_backend().get_indexer_metadata(layer_id, forward_batch)
    if metadata is None:
        return None
    x_meta = x[0] if isinstance(x, tuple) else x
    act_quant = dsa_kernels.act_quant
    if self._should_skip_logits_computation(forward_batch) and not self.dsa_enable_prefill_cp:
        topk = self._forward_cuda_k_only(
            x, positions, forward_batch, layer_id, act_quant, metadata, return_indices
        )
        return m.maybe_capture_indexer_topk(layer_id, m._broadcast_indexer_topk_from_rank0(topk))
    query, key, _ = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)
    q_fp8, q_scale = act_quant(query, self.block_size, self.scale_fmt)
    self._store_index_k_cache(
        forward_batch=forward_batch, layer_id=layer_id, key=key, act_quant=act_quant
    )
    weights = self._get_logits_head_gate(x_meta, q_scale).squeeze(-1)
    topk = torch.full((x_meta.shape[0], self.index_topk), -1, dtype=torch.int32)
    mode = forward_batch.forward_mode
    if forward_batch.seq_lens.numel() > 0:  # an empty (padded) batch selects nothing
        pool = m.get_token_to_kv_pool()
        per_query = mode.is_target_verify() or mode.is_draft_extend_v2()
        if mode.is_decode_or_idle() or per_query:
            _paged_topk(self, pool, layer_id, q_fp8, weights, metadata, topk, per_query)
        else:
            _ragged_topk(self, pool, layer_id, q_fp8, weights, metadata, topk)
    return m.maybe_capture_indexer_topk(layer_id, m._broadcast_indexer_topk_from_rank0(topk))


def _ragged_topk(indexer: Any, pool: Any, layer_id: int, q_fp8: Any, weights: Any, metadata: Any, out: Any) -> None:
    """``_get_topk_ragged``: keys of every request read through the pool by the logical page
    table, logits over each query row's key range, upstream's masks and top-k transform."""
    import torch

    seq_lens_cpu = metadata.get_indexer_seq_len_cpu()
    k_fp8, k_scale = pool.get_index_k_scale_buffer(
        layer_id,
        metadata.get_indexer_seq_len(),
        metadata.get_logical_page_table(),
        int(seq_lens_cpu.sum()),
        int(seq_lens_cpu.max()),
    )
    ks, ke = metadata.get_indexer_kvcache_range()
    rows = ks.shape[0]
    logits = dsa_kernels.mqa_logits(
        q_fp8[:rows],
        k_fp8.view(torch.float8_e4m3fn),
        k_scale.view(torch.float32).reshape(-1),
        weights[:rows],
        ks,
        ke,
    )
    indexer._mask_init_and_local_tokens(logits, metadata.get_seqlens_expanded(), ks)
    out[:rows] = metadata.topk_transform(logits, indexer.index_topk, ks=ks)


def _paged_topk(
    indexer: Any, pool: Any, layer_id: int, q_fp8: Any, weights: Any, metadata: Any, out: Any, per_query: bool
) -> None:
    """``_get_topk_paged``: keys read from the index-K pages of each query's 64-token block
    table, upstream's masks and top-k transform. A decode has one query per request; an
    EAGLE target verify or draft extend (``per_query``) several, each scored as upstream's
    split path does: its own row of the (repeated) block table and its own key count
    (``seqlens_expanded``: the request's keys up to and including that query)."""
    seqlens = metadata.get_seqlens_expanded() if per_query else metadata.get_seqlens_int32()
    rows = sum(metadata.get_dsa_extend_len_cpu())
    block_table = metadata.get_page_table_64()
    if rows != seqlens.shape[0] or rows > block_table.shape[0]:
        raise NotImplementedError(
            f"CPU indexer: {rows} queries for {seqlens.shape[0]} key counts and "
            f"{block_table.shape[0]} block-table rows"
        )
    page_size = pool.index_page_size
    logits = dsa_kernels.paged_mqa_logits(
        q_fp8[:rows],
        indexer._get_index_k_read_buffer(pool, layer_id),
        weights[:rows],
        seqlens,
        block_table,
        page_size,
        block_table.shape[1] * page_size,
    )
    indexer._mask_init_and_local_tokens(logits, seqlens)
    out[:rows] = metadata.topk_transform(logits, indexer.index_topk)


def _eagle_dsa_metadata() -> None:
    def patch(module: Any) -> None:
        module.seqlens_expand_triton = dsa_kernels.seqlens_expand

    watcher = process_watcher()
    watcher.when_imported(DSA_BACKEND, patch)
    watcher.when_imported(DSA_MTP_PRECOMPUTE, patch)


def _spec_decode_allocation() -> None:
    def patch(module: Any) -> None:
        module.get_last_loc_triton = module.get_last_loc_torch

    process_watcher().when_imported(ALLOCATION, patch)


def _indexer() -> None:
    def patch(module: Any) -> None:
        module.Indexer.forward_native = indexer_forward_native
        module.rotate_activation = dsa_kernels.hadamard_rotate

    process_watcher().when_imported(DSA_INDEXER, patch)


# ------------------------------------------------------------------------------ gate
class _CudaDeviceView:
    """A resolution view that reads ``device == "cuda"`` (the sharding gate's CUDA rule)."""

    __slots__ = ("_view",)

    def __init__(self, view: Any):
        object.__setattr__(self, "_view", view)

    def __getattr__(self, name: str) -> Any:
        return "cuda" if name == "device" else getattr(self._view, name)


def _gate() -> None:
    def patch(module: Any) -> None:
        resolving_view = module.resolving_view
        capacity = module.get_device_memory_capacity
        module.resolving_view = lambda server_args, *a, **k: _CudaDeviceView(
            resolving_view(server_args, *a, **k)
        )
        module.get_device_memory_capacity = lambda device=None, *a, **k: capacity(
            "cpu" if device == "cuda" else device, *a, **k
        )

    process_watcher().when_imported(KV_SHARD_GATE, patch)


#: The plugin's lane planner, whose DEBUG lines name each eviction plan (victims per lane).
LANE_EVICTION_LOGGER = "sglang_cp_hicache.v0_5_23.eviction.lane_eviction"


def _lane_decisions_logged() -> None:
    # SGLang's root handler has no level of its own: the planner's DEBUG records reach the
    # server log for the harness to read, nothing else gets more verbose.
    logging.getLogger(LANE_EVICTION_LOGGER).setLevel(logging.DEBUG)


# -------------------------------------------------------------------- unsharded CP L3
CACHE_CONTROLLER = "sglang.srt.managers.cache_controller"


def writers_within_attention_tp(original: Callable) -> Callable:
    """``HiCacheController._generate_storage_config`` with the MLA writer rule applied within
    attention TP under CP: each CP rank writes the pages it keys by its CP rank. Upstream
    0.5.23 keys an unsharded CP prefill's L3 pages by CP rank (``_cp<rank>_<size>``) but lets
    only TP rank 0 write them, so CP rank 1 never finds its pages and no storage hit ever
    comes back (pinned: ``test_upstream_unsharded_cp_l3.py``). The plugin's sharded prefills
    get the same rule from its own hook (``storage/owner_io.py``)."""

    def generate_storage_config(controller: Any, *args: Any, **kwargs: Any) -> Any:
        import dataclasses

        from sglang.srt.runtime_context import get_parallel

        config = original(controller, *args, **kwargs)
        if config.attn_cp_size <= 1:
            return config
        parallel = get_parallel()
        logger.info(
            "CPU runtime step (unsharded CP L3 writers): CP rank %d/%d keys its L3 pages as attention "
            "TP rank %d/%d (upstream: TP rank %d/%d, a writer only at TP rank 0)",
            config.attn_cp_rank, config.attn_cp_size, parallel.attn_tp_rank, parallel.attn_tp_size,
            config.tp_rank, config.tp_size,
        )  # fmt: skip
        return dataclasses.replace(config, tp_rank=parallel.attn_tp_rank, tp_size=parallel.attn_tp_size)

    return generate_storage_config


def _unsharded_cp_l3_writers() -> None:
    def patch(module: Any) -> None:
        controller = module.HiCacheController
        controller._generate_storage_config = writers_within_attention_tp(controller._generate_storage_config)

    process_watcher().when_imported(CACHE_CONTROLLER, patch)


# ---------------------------------------------------------------- Mooncake L3 puts
MOONCAKE_STORE = "sglang.srt.mem_cache.storage.mooncake_store.mooncake_store"
#: What each logged put line starts with (``testing/server/store_view.py`` parses it).
L3_PUTS_LOG = "cp_hicache L3 puts (CPU runtime step):"


def puts_logged(original: Callable) -> Callable:
    """``MooncakeStore._put_batch_zero_copy_impl`` logging, per call, this process's TP rank,
    every key it puts and how many the client answered with an error (the plugin's
    owner-free store calls upstream's method for every batch it puts, so each rank's writes
    are named by key). The client answers 0 for a key the master already holds, too: which
    put the master kept is its own counters' to say (``master_batch_put_end_items_total``)."""

    def put(store: Any, key_strs: Any, *args: Any, **kwargs: Any) -> Any:
        import torch.distributed as dist

        results = original(store, key_strs, *args, **kwargs)
        rank = dist.get_rank() if dist.is_initialized() else 0
        failed = sum(1 for result in results if result != 0)
        logger.info("%s tp rank %d put %d failed %d: %s", L3_PUTS_LOG, rank, len(key_strs), failed, " ".join(key_strs))
        return results

    return put


def _l3_puts_logged() -> None:
    def patch(module: Any) -> None:
        store = module.MooncakeStore
        store._put_batch_zero_copy_impl = puts_logged(store._put_batch_zero_copy_impl)

    process_watcher().when_imported(MOONCAKE_STORE, patch)


def _for_this_server() -> Tuple[RuntimeStep, ...]:
    """Steps only some of the harness's servers get, as their environment says."""
    found = []
    if os.environ.get(UNSHARDED_CP_L3_WRITERS_ENV) == "1":
        found.append(RuntimeStep(
            "unsharded CP prefill's L3: every CP rank writes the pages it keys by its CP rank "
            "(upstream 0.5.23 lets only TP rank 0 write them: no storage hit ever)",
            _unsharded_cp_l3_writers,
        ))  # fmt: skip
    if os.environ.get(L3_PUTS_LOGGED_ENV) == "1":
        found.append(RuntimeStep("Mooncake L3 puts logged by key and TP rank for the harness", _l3_puts_logged))
    return tuple(found)


def steps() -> Tuple[RuntimeStep, ...]:
    """The 0.5.23 runtime, in the order it is applied."""
    return (
        RuntimeStep(
            "SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), torch.compile off, fused DSA top-k off",
            common_steps.set_environment(ENVIRONMENT),
        ),
        RuntimeStep("sgl_kernel stand-in (torch bodies; any other op raises naming it)", _sgl_kernel),
        RuntimeStep(
            "EAGLE's sgl_kernel CPU ops in torch (tree build, greedy tree verify, bonus tokens, "
            "draft and accepted cache locations)",
            _eagle_kernels,
        ),
        RuntimeStep(
            "the project's CPU cache runtime (kvcacheio reference ops, pageable host pools, "
            "CPU stream/event module, gloo shard gather, SetKAndS and MLA row-read stand-ins)",
            _project_runtime,
        ),
        RuntimeStep("torch.cuda.get_device_capability reports an H200 (SM 9.0)", common_steps.hopper_capability),
        RuntimeStep("torch.cuda streams, events and synchronize on the CPU device module", common_steps.cuda_streams_on_cpu),
        RuntimeStep("gloo instead of pynccl in model-parallel groups", common_steps.gloo_groups),
        RuntimeStep(
            "read-path stand-ins (FlashMLA sparse/kv, quantize_k_cache_separate, GetKAndS, "
            "prefill and decode page-table transforms, CP query split)",
            _read_path,
        ),
        RuntimeStep("torch DSA indexer (Indexer.forward_native: act_quant, Hadamard, fp8 MQA logits)", _indexer),
        RuntimeStep(
            "EAGLE's DSA metadata in torch (seqlens_expand: each verify/draft-extend query's key count)",
            _eagle_dsa_metadata,
        ),
        RuntimeStep(
            "EAGLE decode allocation: get_last_loc by upstream's own torch body (get_last_loc_torch)",
            _spec_decode_allocation,
        ),
        RuntimeStep("DeepseekScalingRotaryEmbedding.forward_native fixed for 1-D positions (upstream CPU bug)", common_steps.fixed_rope),
        RuntimeStep("the KV-sharding gate's CUDA-device rule answered for CPU", _gate),
        RuntimeStep("the plugin's device lane-eviction plans logged (DEBUG) for the harness", _lane_decisions_logged),
        *_for_this_server(),
    )


__all__ = ["L3_PUTS_LOG", "indexer_forward_native", "puts_logged", "steps", "writers_within_attention_tp"]
