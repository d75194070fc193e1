"""Torch reference of the NSA read stages the startup self-test compares (CPU runtime).

The same stages as :class:`~sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest.
SGLangCudaKernels`, through SGLang's own torch paths where it has them (``GetK.slow`` /
``GetS.slow``, ``transform_index_page_table_prefill_ref``, ``_dequantize_k_cache_ref``)
and a torch sparse MLA for FlashMLA. Used only where CUDA is absent.
"""

from __future__ import annotations

from typing import Optional, Tuple

import torch

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import (
    FP8_KV_ROW_BYTES,
    KV_LORA_RANK,
    READER_KERNELS,
    ReadSide,
)


def _dequantize_rows(kv: torch.Tensor) -> torch.Tensor:
    from sglang.srt.layers.attention.nsa.dequant_k_cache import _dequantize_k_cache_ref

    return _dequantize_k_cache_ref(kv.view(torch.float8_e4m3fn).view(-1, 1, FP8_KV_ROW_BYTES)).view(-1, 576)


class TorchReferenceKernels:
    name = "torch-reference"
    topk = 64  # the chunk's keys outnumber it, so selection is real
    num_heads = 4

    def get_k_get_s(self, side: ReadSide) -> Tuple[torch.Tensor, ...]:
        from sglang.srt.layers.attention.nsa.index_buf_accessor import GetK, GetS

        out = []
        for i, n in enumerate(side.seq_lens.tolist()):
            pages = side.real_page_table[i]
            out.append(GetK.slow(side.pool, side.index_buffer, n, pages))
            out.append(GetS.slow(side.pool, side.index_buffer, n, pages))
        return tuple(out)

    def get_k_and_s(self, side: ReadSide) -> Tuple[torch.Tensor, ...]:
        parts = self.get_k_get_s(side)
        return torch.cat(parts[0::2]), torch.cat(parts[1::2])

    def topk_transform(self, side: ReadSide, scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor:
        from sglang.srt.layers.attention.nsa.transform_index import (
            transform_index_page_table_prefill_ref,
        )

        columns = torch.arange(scores.shape[1], device=scores.device)
        masked = scores.masked_fill(columns[None, :] >= lengths[:, None], float("-inf"))
        k = min(topk, scores.shape[1])
        values, indices = masked.topk(k, dim=1)
        indices = torch.where(torch.isinf(values), -1, indices).to(torch.int32)
        return transform_index_page_table_prefill_ref(side.page_table_1, indices, list(side.extend_lens))

    def sparse_attention(self, side: ReadSide, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
        kv = side.kv_buffer.reshape(side.kv_buffer.shape[0], -1)
        if kv.shape[-1] == FP8_KV_ROW_BYTES:
            kv = _dequantize_rows(kv)
        keys = kv[indices.clamp(min=0).long()].float()  # [tokens, topk, 576]
        logits = torch.einsum("thd,tkd->thk", q.float(), keys) * q.shape[-1] ** -0.5
        logits = logits.masked_fill((indices < 0)[:, None, :], float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        return torch.einsum("thk,tkd->thd", probs, keys[..., :KV_LORA_RANK]).to(torch.bfloat16)

    def sparse_attention_kv(self, side: ReadSide, q: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor) -> Optional[torch.Tensor]:
        """FlashMLA kv reads the same fp8 rows through the same indices; its torch
        reference is the dequantised sparse attention."""
        if side.kv_buffer.shape[-1] != FP8_KV_ROW_BYTES:
            return None
        return self.sparse_attention(side, q, indices)

    def dequantize_paged(self, side: ReadSide, flat_locs: torch.Tensor) -> Optional[torch.Tensor]:
        kv = side.kv_buffer.reshape(side.kv_buffer.shape[0], -1)
        if kv.shape[-1] != FP8_KV_ROW_BYTES:
            return None
        return _dequantize_rows(kv[flat_locs.long()])


READER_KERNELS["cpu"] = TorchReferenceKernels
