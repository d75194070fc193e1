"""Torch ports of the DSA GPU kernels a server calls, for the CPU server runtime of both lines.

What a server's ``Indexer`` and DSA backend call on a GPU and that has no CPU body in either
release:

* :func:`act_quant`: ``act_quant_triton.act_quant`` (per-block fp8 e4m3 with an fp32 scale,
  amax floored at 1e-4, ``ue8m0`` rounds the scale up to a power of two), ported op for op;
* :func:`hadamard_rotate`: the fast Hadamard transform ``rotate_activation`` applies
  (Sylvester order, scaled by ``n ** -0.5``);
* :func:`mqa_logits`: DeepGEMM's ``fp8_mqa_logits`` (ragged keys of an extend):
  ``logits[m, n] = sum_h w[m, h] * relu(q[m, h] . k[n]) * s[n]`` for ``ks[m] <= n < ke[m]``,
  ``-inf`` elsewhere (what ``clean_logits=True`` writes; upstream's top-k transform masks
  the same range itself);
* :func:`paged_mqa_logits`: DeepGEMM's ``fp8_paged_mqa_logits`` for one query per request
  (decode): the keys of request ``b`` read from the index-K pages of its block table, in the
  page layout ``SetKAndS`` writes (``page_size`` fp8 keys of 128 bytes, then ``page_size``
  fp32 scales);
* :func:`seqlens_expand`: ``pad.seqlens_expand_triton`` (Triton): each query's key count
  in a request extended by ``qo_len`` tokens over ``kv_len`` keys, ``kv_len - qo_len + 1 + j``
  for its ``j``-th query, floored at 0 (EAGLE's target verify and draft extend);
* :func:`transform_index_page_table_decode`: the decode page-table transform (Triton):
  row ``q``'s selected positions ``p >= 0`` become ``page_table[q, p]``, ``-1`` stays;
* :func:`topk_local`, :func:`topk_transform_paged`, :func:`topk_transform_ragged`: 0.5.12's
  ``sgl_kernel`` top-k (``fast_topk_v2`` and the fused page-table and ragged transforms):
  row ``r`` keeps the top ``k`` of ``score[r, s_r : s_r + len_r]`` as positions relative to
  ``s_r`` (``-1`` pads), then maps them through its request's page table, or offsets them
  by the row's ragged offset.

The logits formula is the one the project's reference indexer uses
(``testing.v0_5_23.read_path.StandInIndexer``: ``sum_h gate_h * relu(q_h . k)`` over
dequantized keys); its unit test checks the two agree.
"""

from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
AMAX_FLOOR = 1e-4  # act_quant_triton's floor (not per_token_group_quant's 1e-10)
INDEX_HEAD_DIM = 128
SCALE_BYTES = 4


def act_quant(
    x: torch.Tensor, block_size: int = 128, scale_fmt: Optional[str] = None
) -> Tuple[torch.Tensor, torch.Tensor]:
    """``act_quant_triton.act_quant``: ``(y fp8 like x, scale fp32 [..., N // block_size])``."""
    if not x.is_contiguous():
        raise ValueError("act_quant (CPU port): input must be contiguous")
    if x.size(-1) % block_size:
        raise ValueError(f"act_quant (CPU port): last dim {x.size(-1)} % block {block_size}")
    groups = x.float().reshape(*x.shape[:-1], x.size(-1) // block_size, block_size)
    amax = groups.abs().amax(dim=-1, keepdim=True).clamp(min=AMAX_FLOOR)
    scale = amax * (1.0 / FP8_MAX)
    if scale_fmt is not None:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    y = (groups / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8).reshape(x.shape)
    return y, scale.squeeze(-1)


_HADAMARD: Dict[int, torch.Tensor] = {}


def _hadamard_matrix(n: int) -> torch.Tensor:
    if n not in _HADAMARD:
        if n & (n - 1):
            raise ValueError(f"Hadamard transform (CPU port): {n} is not a power of 2")
        h = torch.ones(1, 1)
        while h.shape[0] < n:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        _HADAMARD[n] = h
    return _HADAMARD[n]


def hadamard_rotate(x: torch.Tensor) -> torch.Tensor:
    """``rotate_activation``: ``x @ H_n * n ** -0.5`` over the last dim, in x's dtype."""
    n = x.size(-1)
    return (x.float() @ _hadamard_matrix(n) * n**-0.5).to(x.dtype)


def mqa_logits(
    q_fp8: torch.Tensor,
    k_fp8: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    ks: torch.Tensor,
    ke: torch.Tensor,
) -> torch.Tensor:
    """``fp8_mqa_logits``: q ``[M, H, D]`` fp8, k ``[N, D]`` fp8 with scales ``[N]``,
    weights ``[M, H]``, each row's key range ``[ks, ke)``; returns ``[M, N]`` fp32."""
    scores = torch.einsum("mhd,nd->mhn", q_fp8.float(), k_fp8.float())
    logits = (torch.relu(scores) * weights.float()[:, :, None]).sum(dim=1) * k_scale.float()[None, :]
    cols = torch.arange(k_fp8.shape[0])[None, :]
    outside = (cols < ks.long()[:, None]) | (cols >= ke.long()[:, None])
    return logits.masked_fill(outside, float("-inf"))


def index_k_pages(
    buffer: torch.Tensor, pages: torch.Tensor, page_size: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys ``[len(pages) * page_size, 128]`` fp8 and scales ``[...]`` fp32 of ``pages`` of
    a page-packed index-K buffer (``[pages, page_size * 132]`` uint8)."""
    rows = buffer.view(torch.uint8).reshape(buffer.shape[0], -1)[pages.long()]
    keys = rows[:, : page_size * INDEX_HEAD_DIM].reshape(-1, INDEX_HEAD_DIM)
    scales = rows[:, page_size * INDEX_HEAD_DIM : page_size * (INDEX_HEAD_DIM + SCALE_BYTES)]
    return keys.contiguous().view(FP8), scales.contiguous().view(torch.float32).reshape(-1)


def paged_mqa_logits(
    q_fp8: torch.Tensor,
    buffer: torch.Tensor,
    weights: torch.Tensor,
    context_lens: torch.Tensor,
    block_table: torch.Tensor,
    page_size: int,
    max_len: int,
) -> torch.Tensor:
    """``fp8_paged_mqa_logits`` with one query per request: q ``[B, H, D]`` fp8, weights
    ``[B, H]``; request ``b`` scores its first ``context_lens[b]`` keys through
    ``block_table[b]``; returns ``[B, max_len]`` fp32, ``-inf`` past each length."""
    batch = q_fp8.shape[0]
    logits = torch.full((batch, max_len), float("-inf"))
    for b in range(batch):
        length = int(context_lens.reshape(-1)[b])
        if length == 0:
            continue
        pages = block_table[b, : (length + page_size - 1) // page_size]
        keys, scales = index_k_pages(buffer, pages, page_size)
        row = mqa_logits(
            q_fp8[b : b + 1],
            keys[:length],
            scales[:length],
            weights[b : b + 1],
            torch.zeros(1, dtype=torch.int32),
            torch.tensor([length], dtype=torch.int32),
        )
        logits[b, :length] = row[0]
    return logits


def seqlens_expand(
    extend_seq_lens: torch.Tensor, seq_lens: torch.Tensor, total_len: int, max_q_len: int
) -> torch.Tensor:
    """``seqlens_expand_triton``: ``[total_len]`` int32, request ``b``'s queries
    ``max(seq_lens[b] - extend_seq_lens[b] + 1 + j, 0)`` for ``j < extend_seq_lens[b]``
    (``max_q_len`` sizes the Triton block only)."""
    rows = [
        max(kv_len - qo_len + 1 + j, 0)
        for qo_len, kv_len in zip(extend_seq_lens.tolist(), seq_lens.tolist())
        for j in range(qo_len)
    ]
    if len(rows) != total_len:
        raise ValueError(f"seqlens_expand (CPU port): {len(rows)} queries, total_len {total_len}")
    return torch.tensor(rows, dtype=torch.int32, device=seq_lens.device)


def transform_index_page_table_decode(
    page_table: torch.Tensor,
    topk_indices: torch.Tensor,
    result: Optional[torch.Tensor] = None,
    page_size: int = 1,
) -> torch.Tensor:
    """``transform_index.transform_index_page_table_decode`` (same asserts, int32 result)."""
    if page_size != 1 or page_table.shape[0] != topk_indices.shape[0]:
        raise ValueError(
            f"transform_index_page_table_decode (CPU port): page_size {page_size}, "
            f"{page_table.shape[0]} page-table rows for {topk_indices.shape[0]} queries"
        )
    selected = topk_indices.long()
    mapped = torch.gather(page_table.long(), 1, selected.clamp(min=0)).to(torch.int32)
    out = torch.where(selected >= 0, mapped, torch.full_like(mapped, -1))
    if result is None:
        return out
    result.copy_(out)
    return result


def topk_local(
    score: torch.Tensor, lengths: torch.Tensor, topk: int, row_starts: Optional[torch.Tensor] = None
) -> torch.Tensor:
    """Top ``topk`` of each row's window ``[row_start, row_start + length)``, as positions
    relative to its start, best first; ``-1`` where the window has fewer."""
    rows, width = score.shape
    out = torch.full((rows, topk), -1, dtype=torch.int32)
    if rows == 0 or topk == 0 or width == 0:
        return out
    starts = torch.zeros(rows, dtype=torch.int64) if row_starts is None else row_starts.long()
    cols = torch.arange(width)[None, :]
    inside = (cols >= starts[:, None]) & (cols < (starts + lengths.long())[:, None])
    values, columns = score.float().masked_fill(~inside, float("-inf")).topk(min(topk, width), dim=-1)
    local = (columns - starts[:, None]).masked_fill(torch.isinf(values) & (values < 0), -1)
    out[:, : local.shape[1]] = local.to(torch.int32)
    return out


def topk_transform_paged(
    score: torch.Tensor,
    lengths: torch.Tensor,
    page_table_size_1: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    topk: int,
    row_starts: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``fast_topk_transform_fused``: :func:`topk_local`, each row's positions mapped through
    the page-size-1 table of its request (rows ``cu_seqlens_q[b] .. cu_seqlens_q[b + 1]``
    belong to request ``b``)."""
    local = topk_local(score, lengths, topk, row_starts)
    bounds = cu_seqlens_q.long()
    request = torch.repeat_interleave(torch.arange(bounds.numel() - 1), (bounds[1:] - bounds[:-1]).clamp(min=0))
    if request.numel() < local.shape[0]:
        raise ValueError(f"topk transform (CPU port): {request.numel()} rows in cu_seqlens_q, {local.shape[0]} scored")
    table = page_table_size_1[request[: local.shape[0]]].long()
    mapped = torch.gather(table, 1, local.long().clamp(min=0)).to(torch.int32)
    return torch.where(local >= 0, mapped, torch.full_like(mapped, -1))


def topk_transform_ragged(
    score: torch.Tensor,
    lengths: torch.Tensor,
    topk_indices_offset: torch.Tensor,
    topk: int,
    row_starts: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """``fast_topk_transform_ragged_fused``: :func:`topk_local` plus each row's offset."""
    local = topk_local(score, lengths, topk, row_starts)
    shifted = local + topk_indices_offset[: local.shape[0]].to(torch.int32)[:, None]
    return torch.where(local >= 0, shifted, torch.full_like(local, -1))


__all__ = [
    "act_quant",
    "hadamard_rotate",
    "index_k_pages",
    "mqa_logits",
    "paged_mqa_logits",
    "seqlens_expand",
    "topk_local",
    "topk_transform_paged",
    "topk_transform_ragged",
    "transform_index_page_table_decode",
]
