"""Torch references of the GPU kernels SGLang 0.5.23's DSA backend runs for ``flashmla_kv``
prefill over the packed fp8 KV cache (FlashMLA's ``V32`` format), with the signatures upstream
calls them by.

The packed row (``kv_cache_dim`` 656 for GLM-5 / DeepSeek-V3.2): ``kv_lora_rank`` fp8 e4m3
NoPE values, one fp32 scale per 128 of them, then the ``qk_rope_head_dim`` RoPE values as raw
bf16 bytes (``kernels/ops/quantization/dsa_quant_k_cache.py``). What reads and writes it on
the extend path (paths under ``sglang/``):

* the store: ``MLATokenToKVPool._write_mla_kv_buffer`` (``srt/mem_cache/memory_pool.py``)
  quantizes through ``quantize_k_cache_separate`` (a Triton kernel, bound in that module),
  then scatters the two byte parts as any MLA row; the sharded pool does the same for its
  scratch stage and its owned rows (``page_interleave_pool.py`` ``set_mla_kv_buffer``);
* the schedule: ``DeepseekSparseAttnBackend._compute_flashmla_metadata`` calls
  ``flash_mla_interface.get_mla_metadata`` once per forward (``dsa_backend.py:4148``);
* the read: ``_forward_flashmla_kv`` (``dsa_backend.py:3309``) views the layer's key buffer
  (the sharded pool's scratch) as 64-token blocks ``[num_blocks, 64, 1, 656]`` and calls
  ``flash_mla_with_kvcache`` in sparse mode: one query token per batch row, ``indices``
  ``[tokens, 1, topk]`` = the PAGED top-k transform of the translated ``page_table_1``, each
  entry ``block * 64 + offset`` into that block view (the block table itself is empty).

The references decode the packed bytes exactly as the format defines them and compute in
float32 in a fixed order, so two runs over the same bytes and indices agree bit for bit;
they check every shape and option the upstream call relies on and refuse anything else, so a
caller that drifts from the format fails here instead of reading garbage. They never need the
logical table: what a row holds depends only on the block view and the index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
#: NoPE values per fp32 scale (``quantize_k_cache_separate``'s ``tile_size``).
NOPE_TILE = 128
#: The RoPE widths the quantizer accepts (0: a NoPE model).
ROPE_DIMS = (0, 64)
#: The only page (FlashMLA block) size ``_forward_flashmla_kv`` runs with.
FLASHMLA_BLOCK_SIZE = 64
SCALE_BYTES = 4


def packed_row_bytes(nope_dim: int, rope_dim: int) -> int:
    """Bytes of one packed token: fp8 NoPE, one fp32 scale per tile, bf16 RoPE."""
    return nope_dim + nope_dim // NOPE_TILE * SCALE_BYTES + rope_dim * 2


# ------------------------------------------------------------------------- store
def quantize_k_cache_separate_reference(
    k_nope: torch.Tensor, k_rope: Optional[torch.Tensor], tile_size: int = NOPE_TILE
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``quantize_k_cache_separate``: ``(nope_part, rope_part)``, uint8
    ``[n, 1, nope + tiles * 4]`` and ``[n, 1, rope * 2]``.

    Per 128-value tile: ``scale = max|y| / 448`` (fp32, no epsilon, as the kernel), values
    ``clamp(y * (1 / scale))`` cast to e4m3; RoPE copied as raw bf16 bytes.
    """
    nope = k_nope.squeeze(1) if k_nope.ndim == 3 else k_nope
    if k_rope is None or k_rope.numel() == 0:
        rope = torch.empty((nope.shape[0], 0), dtype=nope.dtype)
    else:
        rope = k_rope.squeeze(1) if k_rope.ndim == 3 else k_rope
    num_tokens, nope_dim = nope.shape
    if tile_size != NOPE_TILE or nope_dim % tile_size:
        raise ValueError(f"quantize_k_cache_separate (CPU reference): NoPE width {nope_dim}")
    if rope.shape[1] not in ROPE_DIMS or rope.shape[0] != num_tokens:
        raise ValueError(f"quantize_k_cache_separate (CPU reference): RoPE {tuple(rope.shape)}")
    if nope.dtype != torch.bfloat16 or (rope.numel() and rope.dtype != torch.bfloat16):
        raise ValueError("quantize_k_cache_separate (CPU reference): bf16 inputs only")
    fp8_max = torch.finfo(FP8).max
    tiles = nope.float().reshape(num_tokens, -1, tile_size)
    scale = tiles.abs().amax(dim=-1) / fp8_max  # [n, tiles] fp32
    quantized = (tiles * (1.0 / scale)[..., None]).clamp(-fp8_max, fp8_max).to(FP8)
    nope_part = torch.cat(
        [quantized.reshape(num_tokens, nope_dim).view(torch.uint8), scale.view(torch.uint8)],
        dim=1,
    )
    rope_part = rope.contiguous().view(torch.uint8).reshape(num_tokens, -1)
    return nope_part.unsqueeze(1), rope_part.unsqueeze(1)


def dequantize_packed_rows(rows: torch.Tensor, nope_dim: int) -> torch.Tensor:
    """Packed rows ``[..., row_bytes]`` (fp8 or uint8) -> bf16 ``[..., nope + rope]``:
    NoPE ``e4m3 * scale`` (fp32, rounded to bf16 as the kernel feeds its MMA), RoPE as stored."""
    raw = rows.contiguous().view(torch.uint8)
    lead, row_bytes = raw.shape[:-1], raw.shape[-1]
    raw = raw.reshape(-1, row_bytes)
    tiles = nope_dim // NOPE_TILE
    values = raw[:, :nope_dim].contiguous().view(FP8).float().reshape(-1, tiles, NOPE_TILE)
    scales = raw[:, nope_dim : nope_dim + tiles * SCALE_BYTES].contiguous().view(torch.float32)
    nope = (values * scales[..., None]).reshape(-1, nope_dim).to(torch.bfloat16)
    rope = raw[:, nope_dim + tiles * SCALE_BYTES :].contiguous().view(torch.bfloat16)
    return torch.cat([nope, rope], dim=1).reshape(*lead, -1)


# ---------------------------------------------------------------------- schedule
@dataclass(frozen=True)
class FlashMLASchedule:
    """What the reference ``get_mla_metadata`` schedules: the batch it was made for."""

    batch_size: int
    num_heads_q: int
    topk: int


def get_mla_metadata_reference(
    cache_seqlens: Optional[torch.Tensor] = None,
    num_q_tokens_per_head_k: Optional[int] = None,
    num_heads_k: Optional[int] = None,
    num_heads_q: Optional[int] = None,
    is_fp8_kvcache: bool = False,
    topk: Optional[int] = None,
) -> Tuple[FlashMLASchedule, torch.Tensor]:
    """Torch ``get_mla_metadata`` for the sparse fp8 decode kernel: a schedule naming the
    batch, heads and top-k it was made for (the kernel reference refuses any other), and
    ``num_splits`` ``[batch + 1]`` (one split per row: the reference never splits KV)."""
    if cache_seqlens is None or not is_fp8_kvcache or topk is None or num_heads_k != 1:
        raise NotImplementedError(
            "get_mla_metadata (CPU reference): the sparse fp8 schedule with one KV head only"
        )
    if num_q_tokens_per_head_k != num_heads_q:
        raise ValueError("get_mla_metadata (CPU reference): one query token per row expected")
    batch = cache_seqlens.shape[0]
    return (
        FlashMLASchedule(batch, int(num_heads_q), int(topk)),
        torch.arange(batch + 1, dtype=torch.int32),
    )


# -------------------------------------------------------------------------- read
def flash_mla_with_kvcache_reference(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor],
    head_dim_v: int,
    tile_scheduler_metadata: Any,
    num_splits: Optional[torch.Tensor] = None,
    softmax_scale: Optional[float] = None,
    causal: bool = False,
    descale_q: Optional[torch.Tensor] = None,
    descale_k: Optional[torch.Tensor] = None,
    is_fp8_kvcache: bool = False,
    indices: Optional[torch.Tensor] = None,
    attn_sink: Optional[torch.Tensor] = None,
    extra_k_cache: Optional[torch.Tensor] = None,
    extra_indices_in_kvcache: Optional[torch.Tensor] = None,
    topk_length: Optional[torch.Tensor] = None,
    extra_topk_length: Optional[torch.Tensor] = None,
    kv_format: Optional[str] = None,
    *,
    use_legacy: bool = True,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``flash_mla_with_kvcache``, sparse V32 fp8 mode (what ``_forward_flashmla_kv``
    calls): row ``b``'s query ``s`` attends, over every head, to the tokens
    ``k_cache[i // block_size, i % block_size]`` for each ``i`` in ``indices[b, s]`` with
    ``0 <= i < num_blocks * block_size`` (FlashMLA's rule for an invalid index); scores
    over all ``d_qk`` dims, values the first ``head_dim_v``. A query with no valid index
    outputs zeros. Returns ``(out [b, s_q, h_q, d_v] in q's dtype, lse [b, h_q, s_q])``."""
    _refuse_unsupported(
        sparse=indices is not None, fp8=is_fp8_kvcache, kv_format=kv_format, causal=causal,
        descaled=descale_q is not None or descale_k is not None, use_legacy=use_legacy,
        extras=(attn_sink, extra_k_cache, extra_indices_in_kvcache, topk_length, extra_topk_length),
    )  # fmt: skip
    _check_operands(q, k_cache, block_table, cache_seqlens, head_dim_v, tile_scheduler_metadata, num_splits, indices)
    batch, s_q, h_q, d_qk = q.shape
    num_blocks, block_size = k_cache.shape[:2]
    nope_dim = head_dim_v
    scale = softmax_scale if softmax_scale is not None else d_qk**-0.5
    flat = indices.long()
    valid = (flat >= 0) & (flat < num_blocks * block_size)
    safe = torch.where(valid, flat, 0)
    # The block view: the scratch's 64-row blocks, addressed (block, offset).
    packed = k_cache[safe // block_size, safe % block_size, 0]  # [b, s_q, topk, row_bytes]
    rows = dequantize_packed_rows(packed, nope_dim).float()  # [b, s_q, topk, d_qk]
    logits = torch.einsum("bshd,bstd->bsht", q.float(), rows) * scale
    logits = logits.masked_fill(~valid[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)  # [b, s_q, h_q]
    probs = torch.nan_to_num(torch.exp(logits - lse[..., None]), nan=0.0)
    out = torch.einsum("bsht,bstd->bshd", probs, rows[..., :head_dim_v]).to(q.dtype)
    return out, lse.permute(0, 2, 1).contiguous()


def _refuse_unsupported(
    *, sparse: bool, fp8: bool, kv_format: Optional[str], causal: bool, descaled: bool,
    use_legacy: bool, extras: Tuple[Optional[torch.Tensor], ...],
) -> None:  # fmt: skip
    """Only the mode ``_forward_flashmla_kv`` calls (sparse V32 fp8, legacy kernels, no
    descale, sink, extra cache or topk lengths) is modelled; anything else is refused."""
    unsupported = {
        "sparse indices": sparse,
        "fp8 KV": fp8,
        "V32 format": kv_format == "V32",
        "not causal": not causal,
        "no descale": not descaled,
        "no sink / extra cache / topk_length": all(x is None for x in extras),
        "legacy kernels": use_legacy,
    }
    missing = [what for what, ok in unsupported.items() if not ok]
    if missing:
        raise NotImplementedError(f"flash_mla_with_kvcache (CPU reference) needs: {missing}")


def _check_operands(
    q: torch.Tensor, k_cache: torch.Tensor, block_table: Optional[torch.Tensor],
    cache_seqlens: Optional[torch.Tensor], head_dim_v: int, tile_scheduler_metadata: Any,
    num_splits: Optional[torch.Tensor], indices: torch.Tensor,
) -> None:  # fmt: skip
    """The shapes and dtypes the kernel's launcher takes, and a schedule made for this batch."""
    batch, s_q, h_q, d_qk = q.shape
    _, block_size, h_k, row_bytes = k_cache.shape
    checks = {
        "k_cache fp8/uint8 [blocks, 64, 1, packed row]": k_cache.element_size() == 1
        and block_size == FLASHMLA_BLOCK_SIZE
        and h_k == 1
        and row_bytes == packed_row_bytes(head_dim_v, d_qk - head_dim_v),
        "indices [batch, s_q, topk] int32": indices.dtype == torch.int32
        and tuple(indices.shape[:2]) == (batch, s_q),
        "cache_seqlens [batch]": cache_seqlens is not None
        and tuple(cache_seqlens.shape) == (batch,),
        "block_table [batch, *]": block_table is not None and block_table.shape[0] == batch,
        "schedule made for this batch": isinstance(tile_scheduler_metadata, FlashMLASchedule)
        and tile_scheduler_metadata
        == FlashMLASchedule(batch, h_q, indices.shape[2])
        and num_splits is not None
        and num_splits.shape == (batch + 1,),
    }
    failed = [what for what, ok in checks.items() if not ok]
    if failed:
        raise ValueError(f"flash_mla_with_kvcache (CPU reference): {', '.join(failed)}")


__all__ = [
    "FLASHMLA_BLOCK_SIZE",
    "FlashMLASchedule",
    "dequantize_packed_rows",
    "flash_mla_with_kvcache_reference",
    "get_mla_metadata_reference",
    "packed_row_bytes",
    "quantize_k_cache_separate_reference",
]
