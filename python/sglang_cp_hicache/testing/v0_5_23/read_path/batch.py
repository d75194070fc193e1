"""The read path's prefill batch: cached prefixes and a chunk, its logical pages laid as
upstream's rotation lays them, split per CP rank."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import List, Tuple

import torch

from sglang_cp_hicache.core.rotation import lane_of, owner_of
from sglang_cp_hicache.testing.reference_sparse_mla import SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import DSA_PAGE_SIZE


# ---------------------------------------------------------------------------- batch
@dataclass(frozen=True)
class ReadPathBatchSpec:
    """A prefill batch with cached prefixes; lengths in tokens.

    Request 1's first ``shared_prefix_pages`` pages are request 0's (a radix hit), so the
    gather plan dedups them. Each request's pages have cyclic owners from its rotation
    base, as upstream's rotated allocator guarantees (``allocator/page_interleave.py``);
    ``begin_shard_extend`` relies on it and, under ``SGLANG_DEBUG_MEMORY_POOL``, checks it.
    """

    prefix_lens: Tuple[int, ...] = (192, 192, 0)
    extend_lens: Tuple[int, ...] = (45, 70, 20)  # every chunk ends mid-page
    shared_prefix_pages: int = 2
    pages_per_rank: int = 12  # allocatable physical pages per rank (plus trash page 0)
    context_len: int = 512
    chunked_prefill_size: int = 256
    seed: int = 0

    @property
    def seq_lens(self) -> Tuple[int, ...]:
        return tuple(p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True))


@dataclass(frozen=True)
class ReadPathBatch:
    """Identical on every rank: logical locs, the cached prefix's bytes, the chunk input."""

    req_to_token: torch.Tensor  # [batch, width] int32; stale columns hold random locs
    seq_lens: Tuple[int, ...]
    prefix_lens: Tuple[int, ...]
    out_cache_loc: torch.Tensor  # the chunk's logical locs, request order
    prefix_locs: torch.Tensor  # every cached logical loc, unique
    prefix_kv: List[torch.Tensor]  # per layer [len(prefix_locs), kv_cache_dim] bf16
    prefix_index_key: List[torch.Tensor]  # per layer [len(prefix_locs), 128] float
    chunk_hidden: torch.Tensor  # [len(out_cache_loc), hidden] float
    chunk_requests: torch.Tensor  # the request of each chunk token


def _cyclic_pages(
    owners_base: int, count: int, cp_size: int, free_local: List[List[int]]
) -> List[int]:
    """``count`` logical pages whose owners run ``base, base + 1, ...`` mod ``cp_size``
    (logical page = local page * cp_size + owner; local page 0 is the reserved trash)."""
    pages = []
    for k in range(count):
        owner = owner_of(owners_base, k, cp_size)
        pages.append(free_local[owner].pop() * cp_size + owner)
    return pages


def build_batch(config: SparseMLAConfig, spec: ReadPathBatchSpec, cp_size: int) -> ReadPathBatch:
    ps = config.page_size
    gen = torch.Generator().manual_seed(spec.seed)
    free_local = [
        (torch.randperm(spec.pages_per_rank, generator=gen) + 1).tolist() for _ in range(cp_size)
    ]
    seq_lens = spec.seq_lens
    width = max(seq_lens) + 2 * ps
    num_logical_pages = cp_size * (spec.pages_per_rank + 1)
    req_to_token = torch.randint(
        cp_size * ps, num_logical_pages * ps, (len(seq_lens), width),
        generator=gen, dtype=torch.int32,
    )
    row_pages: List[List[int]] = []
    for i, seq_len in enumerate(seq_lens):
        shared = row_pages[0][: spec.shared_prefix_pages] if i == 1 else []
        base = lane_of(shared[0], cp_size) if shared else int(torch.randint(cp_size, (1,), generator=gen))
        need = math.ceil(seq_len / ps) - len(shared)
        pages = shared + _cyclic_pages(base + len(shared), need, cp_size, free_local)
        row_pages.append(pages)
        positions = torch.arange(seq_len)
        locs = torch.tensor(pages)[positions // ps] * ps + positions % ps
        req_to_token[i, :seq_len] = locs.int()
    prefix_locs = torch.unique(
        torch.cat([req_to_token[i, :p] for i, p in enumerate(spec.prefix_lens)])
    ).long()
    chunks = list(enumerate(zip(spec.prefix_lens, seq_lens)))
    out_cache_loc = torch.cat([req_to_token[i, p:s] for i, (p, s) in chunks]).long()

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    return ReadPathBatch(
        req_to_token=req_to_token,
        seq_lens=seq_lens,
        prefix_lens=tuple(spec.prefix_lens),
        out_cache_loc=out_cache_loc,
        prefix_locs=prefix_locs,
        prefix_kv=[
            randn(len(prefix_locs), config.kv_cache_dim).to(config.kv_dtype)
            for _ in range(config.num_layers)
        ],
        prefix_index_key=[
            randn(len(prefix_locs), config.index_head_dim) for _ in range(config.num_layers)
        ],
        chunk_hidden=randn(len(out_cache_loc), config.hidden_size),
        chunk_requests=torch.cat([torch.full((s - p,), i) for i, (p, s) in chunks]),
    )


def split_batch(
    batch: ReadPathBatch, first_extend_lens: Tuple[int, ...]
) -> Tuple[ReadPathBatch, ReadPathBatch]:
    """One extend as two chunks: the first runs ``first_extend_lens`` tokens of each
    request, the second the rest with the first's tokens as prefix. The second batch's
    prefix KV is no input: the first chunk's forward writes it (``prefix_kv`` empty).

    Raises ValueError unless each first chunk ends on a page (the prefix the second chunk
    then has must be page-aligned, as ``begin_shard_extend`` requires) and leaves tokens."""
    ps = DSA_PAGE_SIZE
    mids = tuple(p + e for p, e in zip(batch.prefix_lens, first_extend_lens, strict=True))
    if any(m % ps or m >= s for m, s in zip(mids, batch.seq_lens)):
        raise ValueError(
            f"split_batch: chunk ends {mids} must be page-aligned, before {batch.seq_lens}"
        )
    first_rows, second_rows, start = [], [], 0
    for p, m, s in zip(batch.prefix_lens, mids, batch.seq_lens):
        first_rows.append(torch.arange(start, start + m - p))
        second_rows.append(torch.arange(start + m - p, start + s - p))
        start += s - p
    first_rows, second_rows = torch.cat(first_rows), torch.cat(second_rows)
    rows = batch.req_to_token
    first = dataclasses.replace(
        batch,
        seq_lens=mids,
        out_cache_loc=batch.out_cache_loc[first_rows],
        chunk_hidden=batch.chunk_hidden[first_rows],
        chunk_requests=batch.chunk_requests[first_rows],
    )
    second = dataclasses.replace(
        batch,
        prefix_lens=mids,
        out_cache_loc=batch.out_cache_loc[second_rows],
        prefix_locs=torch.unique(torch.cat([rows[i, :m] for i, m in enumerate(mids)])).long(),
        prefix_kv=[],
        prefix_index_key=[],
        chunk_hidden=batch.chunk_hidden[second_rows],
        chunk_requests=batch.chunk_requests[second_rows],
    )
    return first, second
