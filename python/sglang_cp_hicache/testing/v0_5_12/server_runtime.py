"""The 0.5.12.post1 line's CPU server runtime: the steps that let SGLang 0.5.12.post1's own
``launch_server`` processes serve the tiny DSA model on a CPU-only box (test-only; applied by
the serving harness through :mod:`sglang_cp_hicache.testing.server.runtime`).

0.5.12 reaches more Triton and CUDA-only code on a CPU than 0.5.23 (its allocator, the
``req_to_token`` writes, the MLA row write, the NSA index-K accessors, the round-robin CP
split, SGLang's registered collectives, pinned host tensors); each has a step here. Both
servers of a comparison run the same steps.
"""

from __future__ import annotations

import functools
import logging
import sys
import types
from typing import Any, Optional, Tuple

from sglang_cp_hicache.core.import_watcher import process_watcher
from sglang_cp_hicache.testing.server import common_steps, dsa_kernels
from sglang_cp_hicache.testing.server.runtime import RuntimeStep

logger = logging.getLogger(__name__)

NSA_INDEXER = "sglang.srt.layers.attention.nsa.nsa_indexer"
INDEX_BUF_ACCESSOR = "sglang.srt.layers.attention.nsa.index_buf_accessor"
NSA_UTILS = "sglang.srt.layers.attention.nsa.utils"

ENVIRONMENT = {
    "SGLANG_USE_CPU_ENGINE": "1",
    # Dynamo trips over the CPU cache runtime's torch.get_device_module; compiled helpers
    # run eagerly.
    "TORCHDYNAMO_DISABLE": "1",
    # 0.5.12's unfused top-k path asserts under round-robin CP; the fused transform is the
    # one a GPU server runs.
    "SGLANG_NSA_FUSE_TOPK": "1",
    "SGLANG_CUDA_COREDUMP_BEFORE_CRASH_WAIT_SECS": "0",
}


# ------------------------------------------------------------------------ sgl_kernel
def _sgl_kernel() -> None:
    """The 0.5.12 CPU runtime registers a strict ``sgl_kernel`` (its ``kvcacheio``); the
    CPU engine's ops and the NSA top-k and FlashMLA sparse stand-ins are added onto it."""
    from sglang_cp_hicache.testing import install
    from sglang_cp_hicache.testing.reference_sparse_mla import flash_mla_sparse_fwd_reference
    from sglang_cp_hicache.testing.server import sgl_kernel_stand_in

    install()
    package = sgl_kernel_stand_in.install(())
    package.fast_topk_v2 = dsa_kernels.topk_local
    package.fast_topk_transform_fused = dsa_kernels.topk_transform_paged
    package.fast_topk_transform_ragged_fused = dsa_kernels.topk_transform_ragged
    flash_mla = types.ModuleType("sgl_kernel.flash_mla")
    flash_mla.flash_mla_sparse_fwd = flash_mla_sparse_fwd_reference
    package.flash_mla = flash_mla
    sys.modules[flash_mla.__name__] = flash_mla


# ----------------------------------------------------------------- collectives, pins
def _collectives_on_gloo() -> None:
    """``GroupCoordinator.all_gather_into_tensor`` / ``reduce_scatter_tensor`` call SGLang's
    registered ops (``sglang::reg_*``), which have no CPU kernel: gather on byte views over
    the gloo device group; reduce-scatter as an fp32 all-reduce keeping this rank's chunk
    (gloo has no reduce-scatter)."""
    import torch

    def all_gather_into_tensor(self: Any, output: Any, input: Any) -> Any:
        gathered = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
        torch.distributed.all_gather_into_tensor(
            gathered.view(-1).view(torch.uint8), input.contiguous().view(-1).view(torch.uint8), group=self.device_group
        )
        if gathered is not output:
            output.copy_(gathered)
        return output

    def reduce_scatter_tensor(self: Any, output: Any, input: Any) -> Any:
        total = input.float().contiguous()
        torch.distributed.all_reduce(total, group=self.device_group)
        rows = output.shape[0]
        output.copy_(total[self.rank_in_group * rows : (self.rank_in_group + 1) * rows].to(output.dtype))
        return output

    def patch(module: Any) -> None:
        coordinator = module.GroupCoordinator
        coordinator.all_gather_into_tensor = all_gather_into_tensor
        coordinator.reduce_scatter_tensor = reduce_scatter_tensor
        coordinator.cp_all_gather_into_tensor_async = lambda self, output, input, stream=None: all_gather_into_tensor(self, output, input)

    process_watcher().when_imported(common_steps.PARALLEL_STATE, patch)


def _pins_dropped() -> None:
    """No CUDA driver to pin host memory with: ``pin_memory=True`` on torch's factories and
    ``Tensor.pin_memory()`` become plain host tensors (0.5.12 asks in 52 places)."""
    import torch

    def unpinned(factory: Any) -> Any:
        @functools.wraps(factory)
        def make(*args: Any, **kwargs: Any) -> Any:
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return make

    for name in ("tensor", "empty", "zeros", "ones", "full", "as_tensor", "arange"):
        setattr(torch, name, unpinned(getattr(torch, name)))
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


# ------------------------------------------------------------------ Triton kernels
class _DecodeAllocLaunch:
    """``alloc_decode_kernel[grid](seq_lens, last_loc, free_pages, out, bs_upper, page_size)``:
    a request crossing into a new page gets that page's first slot (pages taken in request
    order), any other the slot after its last one."""

    def __getitem__(self, grid: Any):
        import torch

        def launch(seq_lens: Any, last_loc: Any, free_pages: Any, out_indices: Any, _bs_upper: int, page_size: int) -> None:
            before = seq_lens - 1
            new_pages = (seq_lens + page_size - 1) // page_size - (before + page_size - 1) // page_size
            first_page = torch.cumsum(new_pages, 0) - new_pages
            for row in range(seq_lens.shape[0]):
                if int(new_pages[row]) == 0:
                    out_indices[row] = last_loc[row] + 1
                else:
                    out_indices[row] = free_pages[int(first_page[row])] * page_size

        return launch


class _RoundRobinSplitLaunch:
    """``nsa_cp_round_robin_split_q_seqs_kernel[grid](in, out, bs_idx, tokens, cp, rank)``."""

    def __getitem__(self, grid: Any):
        from sglang_cp_hicache.testing.reference_sparse_mla import interleave_split

        def launch(in_seqs: Any, out_seqs: Any, bs_idx: Any, tokens: int, cp_size: int, cp_rank: int) -> None:
            lens, rows = interleave_split(in_seqs[:tokens].tolist(), cp_size, cp_rank)
            for j, (share, row) in enumerate(zip(lens, rows)):
                out_seqs[j] = share
                bs_idx[j] = row

        return launch


def _triton_kernels() -> None:
    from sglang_cp_hicache.testing.reference_sparse_mla import (
        get_mla_kv_buffer_reference,
        set_mla_kv_buffer_reference,
    )
    from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch

    watcher = process_watcher()

    def allocator(module: Any) -> None:
        module.alloc_extend_kernel = NaiveExtendLaunch()
        module.alloc_decode_kernel = _DecodeAllocLaunch()

    def no_triton(module: Any) -> None:
        module.support_triton = lambda backend: False  # the torch req_to_token writes

    def memory_pool(module: Any) -> None:
        module.set_mla_kv_buffer_triton = set_mla_kv_buffer_reference
        module.get_mla_kv_buffer_triton = get_mla_kv_buffer_reference

    def index_buf(module: Any) -> None:
        module.GetKAndS.triton = classmethod(_get_k_and_s)
        for name in ("GetK", "GetS"):
            getattr(module, name).execute = classmethod(lambda cls, *a, **k: cls.slow(*a, **k))
        for name in ("SetK", "SetS"):
            getattr(module, name).execute = classmethod(lambda cls, *a, buf, **k: cls.slow(*a, buf=buf, **k))
        module.SetKAndS.execute = classmethod(lambda cls, *a, buf, **k: cls.vanilla(*a, buf=buf, **k))

    def split(module: Any) -> None:
        module.nsa_cp_round_robin_split_q_seqs_kernel = _RoundRobinSplitLaunch()

    watcher.when_imported("sglang.srt.mem_cache.allocator", allocator)
    watcher.when_imported("sglang.srt.mem_cache.common", no_triton)
    watcher.when_imported("sglang.srt.model_executor.forward_batch_info", no_triton)
    watcher.when_imported("sglang.srt.mem_cache.memory_pool", memory_pool)
    watcher.when_imported(INDEX_BUF_ACCESSOR, index_buf)
    watcher.when_imported(NSA_UTILS, split)


def _get_k_and_s(cls: Any, pool: Any, buf: Any, page_indices: Any, seq_len_tensor: Any, seq_len_sum: int, max_seq_len: int) -> Tuple[Any, Any]:
    """``GetKAndS.triton`` through upstream's own torch ``GetK.slow`` / ``GetS.slow``."""
    import torch

    from sglang.srt.layers.attention.nsa.index_buf_accessor import GetK, GetS

    tables = page_indices if page_indices.dim() == 2 else page_indices[None]
    keys, scales = [], []
    for row, seq_len in enumerate(seq_len_tensor.tolist()):
        keys.append(GetK.slow(pool, buf, int(seq_len), tables[row]))
        scales.append(GetS.slow(pool, buf, int(seq_len), tables[row]))
    return torch.cat(keys), torch.cat(scales)


# ---------------------------------------------------------------------------- indexer
def indexer_forward_native(
    self: Any, x: Any, q_lora: Any, positions: Any, forward_batch: Any, layer_id: int, return_indices: bool = True
) -> Optional[Any]:
    """``Indexer.forward_cuda``'s eager path with the kernels in torch (upstream's q/k
    projection, rope, rotation, CP key gather, K-cache store, head gates and top-k
    transform; :mod:`~sglang_cp_hicache.testing.server.dsa_kernels` for act_quant and the
    fp8 MQA logits), run inside the plugin's own indexer hook, as ``forward_cuda`` is on a GPU
    (the CPU engine dispatches ``forward_native``, which the plugin does not hook)."""
    from sglang_cp_hicache.v0_5_12.layers.attention.nsa_backend_hooks import indexer_forward_around

    return indexer_forward_around(
        _indexer_body, self, x, q_lora, positions, forward_batch, layer_id, return_indices=return_indices
    )


def _indexer_body(
    self: Any, x: Any, q_lora: Any, positions: Any, forward_batch: Any, layer_id: int, return_indices: bool = True
) -> Optional[Any]:
    import torch

    from sglang.srt.layers.attention.nsa import nsa_indexer as m

    metadata = forward_batch.attn_backend.get_indexer_metadata(layer_id, forward_batch)
    if metadata is None:
        return None
    x_meta = x[0] if isinstance(x, tuple) else x
    act_quant = dsa_kernels.act_quant
    mode = forward_batch.forward_mode
    if (
        mode.is_extend_without_speculative()
        and forward_batch.seq_lens_cpu is not None
        and forward_batch.seq_lens_cpu.max().item() <= self.index_topk
        and not self.nsa_enable_prefill_cp
    ):
        topk = self._forward_cuda_k_only(x, positions, forward_batch, layer_id, act_quant, False, metadata, return_indices)
        return m.maybe_capture_indexer_topk(layer_id, topk)
    query, key = self._get_q_k_bf16(q_lora, x, positions, False, forward_batch=forward_batch)
    q_fp8, q_scale = act_quant(query, self.block_size, self.scale_fmt)
    self._store_index_k_cache(forward_batch=forward_batch, layer_id=layer_id, key=key, act_quant=act_quant)
    weights = self._get_logits_head_gate(x_meta, q_scale).squeeze(-1)
    out = torch.full((x_meta.shape[0], self.index_topk), -1, dtype=torch.int32)
    pool = forward_batch.token_to_kv_pool
    if len(forward_batch.seq_lens_cpu) == 0:  # an empty (padded) batch selects nothing
        return m.maybe_capture_indexer_topk(layer_id, out)
    if mode.is_decode_or_idle() or mode.is_target_verify() or mode.is_draft_extend(include_v2=True):
        rows = sum(metadata.get_nsa_extend_len_cpu())
        seqlens = metadata.get_seqlens_int32()
        if rows != seqlens.shape[0]:
            raise NotImplementedError(f"CPU indexer: {rows} queries for {seqlens.shape[0]} requests (next_n > 1)")
        table = metadata.get_page_table_64()
        logits = dsa_kernels.paged_mqa_logits(
            q_fp8[:rows], pool.get_index_k_with_scale_buffer(layer_id=layer_id), weights[:rows],
            seqlens, table, pool.page_size, table.shape[1] * pool.page_size,
        )  # fmt: skip
        out[:rows] = metadata.topk_transform(logits, self.index_topk)
    else:
        lens = metadata.get_indexer_seq_len_cpu()
        k_fp8, k_scale = pool.get_index_k_scale_buffer(
            layer_id, metadata.get_indexer_seq_len(), metadata.get_page_table_64(), int(lens.sum()), int(lens.max())
        )
        ks, ke = metadata.get_indexer_kvcache_range()
        rows = ks.shape[0]
        logits = dsa_kernels.mqa_logits(
            q_fp8[:rows], k_fp8.view(torch.float8_e4m3fn), k_scale.view(torch.float32).reshape(-1), weights[:rows], ks, ke
        )
        out[:rows] = metadata.topk_transform(logits, self.index_topk, ks=ks)
    return m.maybe_capture_indexer_topk(layer_id, out)


def _indexer() -> None:
    def patch(module: Any) -> None:
        module.Indexer.forward_native = indexer_forward_native
        module.Indexer.forward_cpu = indexer_forward_native
        module.rotate_activation = dsa_kernels.hadamard_rotate

    process_watcher().when_imported(NSA_INDEXER, patch)


def steps() -> Tuple[RuntimeStep, ...]:
    """The 0.5.12.post1 runtime, in the order it is applied."""
    return (
        RuntimeStep(
            "SGLang's CPU engine (SGLANG_USE_CPU_ENGINE=1), torch.compile off, fused NSA top-k on",
            common_steps.set_environment(ENVIRONMENT),
        ),
        RuntimeStep(
            "the project's CPU cache runtime with its strict sgl_kernel stand-in (kvcacheio reference "
            "ops, pageable host pools, CPU device module), plus torch NSA top-k and FlashMLA sparse",
            _sgl_kernel,
        ),
        RuntimeStep("torch.cuda.get_device_capability reports an H200 (SM 9.0)", common_steps.hopper_capability),
        RuntimeStep("torch.cuda streams, events and synchronize on the CPU device module", common_steps.cuda_streams_on_cpu),
        RuntimeStep("gloo instead of pynccl in model-parallel groups", common_steps.gloo_groups),
        RuntimeStep("SGLang's registered all-gather / reduce-scatter over gloo", _collectives_on_gloo),
        RuntimeStep("pin_memory requests dropped (no CUDA driver to pin with)", _pins_dropped),
        RuntimeStep(
            "Triton stand-ins (allocator, req_to_token writes, MLA row write/read, NSA index-K "
            "accessors, round-robin CP split)",
            _triton_kernels,
        ),
        RuntimeStep("torch NSA indexer through the plugin's indexer hook (Indexer.forward_native)", _indexer),
        RuntimeStep("DeepseekScalingRotaryEmbedding.forward_native fixed for 1-D positions (upstream CPU bug)", common_steps.fixed_rope),
    )


__all__ = ["indexer_forward_native", "steps"]
