"""The startup self-test's inputs: a seeded prefill batch, identical on every rank, and the
two pools it runs on (the replicated reference and this rank's stripe).

Shapes that matter for upstream 0.5.23's sharded read path
(``mem_cache/page_interleave_pool.py``): page-aligned cached prefixes (a sharded extend
refuses any other, ``begin_shard_extend``), one request sharing another's leading pages
(a radix hit: the gather plan dedups them), chunks that end mid-page, and per-request
cyclic owners from a rotation base (what upstream's rotated allocator guarantees and the
gather block bound relies on). Imports no SGLang at module level.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Tuple

import torch

from sglang_cp_hicache.core.rotation import lane_of, owner_of

FP8_MAX = 448.0  # float8_e4m3fn
INDEX_SCALE_BLOCK = 128  # one fp32 scale per 128 index-K values (DSATokenToKVPool)


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class SelfTestBatchSpec:
    """Request shapes in pages (prefix) and tokens (extend); ``num_layers >= 3`` so a stale
    scratch slot holds an earlier layer's prefix, not zeros."""

    prefix_pages: Tuple[int, ...] = (3, 3, 0)
    extend_lens: Tuple[int, ...] = (45, 70, 20)  # every chunk ends mid-page
    shared_prefix_pages: int = 2  # request 1 starts with request 0's first pages
    num_layers: int = 3
    seed: int = 2305


@dataclass(frozen=True)
class SelfTestGeometry:
    """The server pool's KV geometry, which the self-test's own pools copy."""

    page_size: int
    kv_lora_rank: int
    qk_rope_head_dim: int
    kv_cache_dim: int
    index_head_dim: int
    dtype: torch.dtype  # the pool's dtype (float8_e4m3fn for the packed fp8 store)
    store_fp8: bool

    @classmethod
    def of_pool(cls, pool: Any) -> "SelfTestGeometry":
        return cls(
            page_size=pool.page_size,
            kv_lora_rank=pool.kv_lora_rank,
            qk_rope_head_dim=pool.qk_rope_head_dim,
            kv_cache_dim=pool.kv_cache_dim,
            index_head_dim=pool.index_head_dim,
            dtype=pool.dtype,
            store_fp8=bool(pool.dsa_kv_cache_store_fp8),
        )

    @property
    def kv_format(self) -> str:
        """``bf16`` or ``fp8`` (the packed nope | scales | rope rows FlashMLA kv reads)."""
        return "fp8" if self.store_fp8 else "bf16"


@dataclass(frozen=True)
class SelfTestBatch:
    """Logical state, identical on every rank."""

    req_to_token: torch.Tensor  # [bs, width] int32 (CPU); unused columns hold valid locs
    prefix_lens: Tuple[int, ...]
    seq_lens: Tuple[int, ...]
    out_cache_loc: torch.Tensor  # the chunk's logical locs, batch order (CPU, int64)
    prefix_locs: torch.Tensor  # every cached logical loc, unique (CPU, int64)
    pages_per_rank: int  # allocatable physical pages per rank (local page 0 is trash)
    prefix_block_pages: int  # upstream's gather block bound, sum_i ceil(K_i / N)
    chunk_pages: int

    @property
    def extend_lens(self) -> Tuple[int, ...]:
        return tuple(s - p for p, s in zip(self.prefix_lens, self.seq_lens))


def build_selftest_batch(spec: SelfTestBatchSpec, cp_size: int, page_size: int) -> SelfTestBatch:
    """Seeded batch: logical page = local page * cp + owner, each request's pages with
    cyclic owners from a seeded rotation base, the shared pages first in request 1."""
    ps = page_size
    gen = torch.Generator().manual_seed(spec.seed)
    prefix_lens = tuple(p * ps for p in spec.prefix_pages)
    seq_lens = tuple(p + e for p, e in zip(prefix_lens, spec.extend_lens, strict=True))
    pages_needed = [_ceil_div(n, ps) for n in seq_lens]
    pages_per_rank = sum(_ceil_div(n, cp_size) for n in pages_needed) + 1
    free_local = [
        (torch.randperm(pages_per_rank, generator=gen) + 1).tolist() for _ in range(cp_size)
    ]
    rows: List[List[int]] = []
    for i, need in enumerate(pages_needed):
        shared = rows[0][: spec.shared_prefix_pages] if i == 1 else []
        base = lane_of(shared[0], cp_size) if shared else int(torch.randint(cp_size, (1,), generator=gen))
        pages = list(shared)
        for k in range(len(shared), need):
            owner = owner_of(base, k, cp_size)
            pages.append(free_local[owner].pop() * cp_size + owner)
        rows.append(pages)
    width = max(seq_lens) + ps
    # Columns past a request's length are never read; any valid loc keeps them in range.
    req_to_token = torch.full((len(seq_lens), width), cp_size * ps, dtype=torch.int32)
    for i, (pages, seq_len) in enumerate(zip(rows, seq_lens)):
        positions = torch.arange(seq_len)
        req_to_token[i, :seq_len] = (torch.tensor(pages)[positions // ps] * ps + positions % ps).int()
    prefix_locs = torch.unique(
        torch.cat([req_to_token[i, :p] for i, p in enumerate(prefix_lens)])
    ).long()
    out_cache_loc = torch.cat(
        [req_to_token[i, p:s] for i, (p, s) in enumerate(zip(prefix_lens, seq_lens))]
    ).long()
    return SelfTestBatch(
        req_to_token=req_to_token,
        prefix_lens=prefix_lens,
        seq_lens=seq_lens,
        out_cache_loc=out_cache_loc,
        prefix_locs=prefix_locs,
        pages_per_rank=pages_per_rank,
        prefix_block_pages=sum(_ceil_div(p, cp_size) for p in spec.prefix_pages),
        chunk_pages=sum(_ceil_div(s, ps) - p // ps for p, s in zip(prefix_lens, seq_lens)),
    )


@dataclass(frozen=True)
class LayerInputs:
    """One layer's seeded inputs (bf16 as the model produces them; the pools store them in
    their own format)."""

    prefix_nope: torch.Tensor  # [P, 1, kv_lora_rank]
    prefix_rope: torch.Tensor  # [P, 1, rope]
    prefix_index_key: torch.Tensor  # [P, 128] float
    chunk_nope: torch.Tensor  # [T, 1, kv_lora_rank], the whole chunk (as CP gathers it)
    chunk_rope: torch.Tensor  # [T, 1, rope]
    chunk_index_key: torch.Tensor  # [T, 128] float
    q_nope: torch.Tensor  # [T, heads, kv_lora_rank], every chunk token's query
    q_rope: torch.Tensor  # [T, heads, rope]
    index_query: torch.Tensor  # [T, 128] float


def seeded_layer_inputs(
    batch: SelfTestBatch, geometry: SelfTestGeometry, num_heads: int, num_layers: int, seed: int
) -> List[LayerInputs]:
    """The same tensors on every rank (CPU generator, moved to the device by the caller)."""
    gen = torch.Generator().manual_seed(seed + 1)
    r, rope, d = geometry.kv_lora_rank, geometry.qk_rope_head_dim, geometry.index_head_dim
    num_prefix, num_chunk = len(batch.prefix_locs), len(batch.out_cache_loc)

    def bf16(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(torch.bfloat16)

    return [
        LayerInputs(
            prefix_nope=bf16(num_prefix, 1, r),
            prefix_rope=bf16(num_prefix, 1, rope),
            prefix_index_key=torch.randn(num_prefix, d, generator=gen),
            chunk_nope=bf16(num_chunk, 1, r),
            chunk_rope=bf16(num_chunk, 1, rope),
            chunk_index_key=torch.randn(num_chunk, d, generator=gen),
            q_nope=bf16(num_chunk, num_heads, r),
            q_rope=bf16(num_chunk, num_heads, rope),
            index_query=torch.randn(num_chunk, d, generator=gen),
        )
        for _ in range(num_layers)
    ]


def quantize_index_key(key: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Per-token fp8 e4m3 keys and fp32 scales ``[n, 1]``, the indexer cache's format."""
    scale = (key.abs().amax(dim=-1, keepdim=True).float() / FP8_MAX).clamp(min=1e-12)
    return (key.float() / scale).to(torch.float8_e4m3fn), scale


def dequantize_index_read(keys: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The pool's index-K read (uint8 keys ``[n, 128]``, uint8 scales ``[n, 4]``) as float."""
    return keys.contiguous().view(torch.float8_e4m3fn).float() * scales.contiguous().view(
        torch.float32
    )


@dataclass(frozen=True)
class SelfTestPools:
    """Fresh upstream pools with the server's geometry on this rank's device: the
    replicated ``DSATokenToKVPool`` (every logical page at its logical loc) and this rank's
    ``PageInterleaveDSATokenToKVPool`` stripe over the server's shard group, its scratch
    sized for this batch (the server's eight-context scratch is not allocated twice)."""

    geometry: SelfTestGeometry
    batch: SelfTestBatch
    num_layers: int
    device: Any

    def _kwargs(self) -> dict:
        g = self.geometry
        return dict(
            page_size=g.page_size,
            kv_lora_rank=g.kv_lora_rank,
            dtype=g.dtype,
            qk_rope_head_dim=g.qk_rope_head_dim,
            layer_num=self.num_layers,
            device=str(self.device),
            index_head_dim=g.index_head_dim,
            enable_memory_saver=False,
            kv_cache_dim=g.kv_cache_dim,
        )

    def replicated(self, cp_size: int) -> Any:
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        ps = self.geometry.page_size
        return DSATokenToKVPool(cp_size * (self.batch.pages_per_rank + 1) * ps - ps, **self._kwargs())

    def sharded(self, shard_group: Any) -> Any:
        from sglang.srt.mem_cache.page_interleave import PageShardSpec
        from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

        ps, size = self.geometry.page_size, shard_group.world_size
        spec = PageShardSpec(
            shard_rank=shard_group.rank_in_group,
            shard_size=size,
            page_size=ps,
            max_prefix_tokens=max(1, self.batch.prefix_block_pages) * size * ps,
            chunk_tokens=self.batch.chunk_pages * ps,
        )
        return PageInterleaveDSATokenToKVPool(
            self.batch.pages_per_rank * ps, shard_spec=spec, shard_group=shard_group, **self._kwargs()
        )


__all__ = [
    "LayerInputs",
    "SelfTestBatch",
    "SelfTestBatchSpec",
    "SelfTestGeometry",
    "SelfTestPools",
    "build_selftest_batch",
    "dequantize_index_read",
    "quantize_index_key",
    "seeded_layer_inputs",
]
