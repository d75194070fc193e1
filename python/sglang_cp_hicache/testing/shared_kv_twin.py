"""CPU/GPU twin of one prefill forward with a cached prefix: shared KV vs replicated KV.

Every CP rank builds the same batch (same seeds): requests with cached prefixes (one
prefix page shared between two requests, a partial last prefix page continued by the
chunk), stale ``req_to_token`` columns past each request, a current chunk split
round-robin over the ranks like NSA prefill CP.

* *replicated*: every rank's pool holds every page at its logical loc (upstream today);
  the reference components run unhooked.
* *shared*: each rank's pool holds only its owned pages, written through the write-path
  translation; the reference components run wrapped by the real hook functions of
  :mod:`nsa_backend_hooks` (exactly as ``HookRegistry`` wraps SGLang's), which materialise
  the prefix with the chosen strategy.

The final hidden states must be identical. :meth:`TwinRank.owned_pages_only` checks that a
shared pool holds exactly its owned pages, with the replicated pool's bytes, after the
forward (prefix and current chunk).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from sglang_cp_hicache.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.layers.attention.cp_shared_kv_write import translate_out_cache_loc
from sglang_cp_hicache.testing.reference_sparse_mla import (
    QueryTokens,
    ReferenceIndexer,
    ReferenceNSABackend,
    ReferenceNSAPool,
    ReferenceSparseMLAModel,
    SparseMLAConfig,
    random_weights,
    store_prefix,
)
from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import CpSharedKVLayout


@dataclass(frozen=True)
class TwinBatchSpec:
    prefix_lens: tuple = (37, 24, 0)
    extend_lens: tuple = (11, 9, 7)
    shared_prefix_pages: int = 2  # request 1 reuses request 0's first pages (radix hit)
    physical_pages: int = 40  # per rank, padding page excluded
    seed: int = 0


@dataclass(frozen=True)
class TwinBatch:
    """Identical on every rank: logical locs, prefix KV and the chunk's hidden states."""

    req_to_token: torch.Tensor
    seq_lens: tuple
    prefix_lens: tuple
    out_cache_loc: torch.Tensor
    prefix_locs: torch.Tensor
    prefix_kv: List[torch.Tensor]
    prefix_index_k: List[torch.Tensor]
    chunk_hidden: torch.Tensor
    token_rows: torch.Tensor
    token_positions: torch.Tensor


def build_twin_batch(config: SparseMLAConfig, spec: TwinBatchSpec, cp_size: int, device) -> TwinBatch:
    ps = config.page_size
    gen = torch.Generator().manual_seed(spec.seed)
    seq_lens = tuple(p + e for p, e in zip(spec.prefix_lens, spec.extend_lens, strict=True))
    # Logical pages 0 .. cp_size - 1 map to physical page 0 (padding): never allocated.
    num_logical_pages = cp_size * (spec.physical_pages + 1)
    free = (torch.randperm(num_logical_pages - cp_size, generator=gen) + cp_size).tolist()
    width = max(seq_lens) + 3 * ps
    # int32 like SGLang's ReqToTokenPool; stale columns past each request hold random locs.
    req_to_token = torch.randint(0, num_logical_pages * ps, (len(seq_lens), width), generator=gen, dtype=torch.int32)
    row_pages: List[List[int]] = []
    for i, seq_len in enumerate(seq_lens):
        reused = row_pages[0][: spec.shared_prefix_pages] if i == 1 else []
        pages = reused + [free.pop() for _ in range(math.ceil(seq_len / ps) - len(reused))]
        row_pages.append(pages)
        positions = torch.arange(seq_len)
        req_to_token[i, :seq_len] = (torch.tensor(pages)[positions // ps] * ps + positions % ps).int()
    prefix_locs = torch.unique(
        torch.cat([req_to_token[i, :p] for i, p in enumerate(spec.prefix_lens)])
    ).long()
    out_cache_loc = torch.cat(
        [req_to_token[i, p:s] for i, (p, s) in enumerate(zip(spec.prefix_lens, seq_lens))]
    ).long()
    rows = torch.cat([torch.full((e,), i) for i, e in enumerate(spec.extend_lens)])
    positions = torch.cat([torch.arange(p, s) for p, s in zip(spec.prefix_lens, seq_lens)])

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device)

    return TwinBatch(
        req_to_token=req_to_token.to(device),
        seq_lens=seq_lens,
        prefix_lens=tuple(spec.prefix_lens),
        out_cache_loc=out_cache_loc.to(device),
        prefix_locs=prefix_locs.to(device),
        prefix_kv=[randn(len(prefix_locs), config.kv_cache_dim) for _ in range(config.num_layers)],
        prefix_index_k=[randn(len(prefix_locs), config.index_head_dim) for _ in range(config.num_layers)],
        chunk_hidden=randn(len(out_cache_loc), config.hidden_size),
        token_rows=rows.to(device),
        token_positions=positions.to(device),
    )


@dataclass
class TwinForwardBatch:
    """The ``ForwardBatch`` fields the reference components and the hooks read."""

    forward_mode: Any
    batch_size: int
    req_to_token_pool: Any
    req_pool_indices: torch.Tensor
    seq_lens_cpu: torch.Tensor
    extend_prefix_lens_cpu: List[int]
    out_cache_loc: torch.Tensor
    token_to_kv_pool: Any
    attn_backend: Any
    query_tokens: QueryTokens


class HookedBackend(ReferenceNSABackend):
    """The reference backend wrapped by the real hooks, as ``HookRegistry`` wraps SGLang's."""

    def init_forward_metadata(self, forward_batch):
        return hooks.init_forward_metadata_around(ReferenceNSABackend.init_forward_metadata, self, forward_batch)

    def forward_extend(self, *args, **kwargs):
        return hooks.forward_extend_around(ReferenceNSABackend.forward_extend, self, *args, **kwargs)


class HookedIndexer(ReferenceIndexer):
    def forward_cuda(self, *args, **kwargs):
        return hooks.indexer_forward_around(ReferenceIndexer.forward_cuda, self, *args, **kwargs)

    def _store_index_k_cache(self, *args, **kwargs):
        return hooks.store_index_k_cache_around(ReferenceIndexer._store_index_k_cache, self, *args, **kwargs)


class HookedModel(ReferenceSparseMLAModel):
    def forward(self, *args, **kwargs):
        return hooks.model_forward_around(ReferenceSparseMLAModel.forward, self, *args, **kwargs)


def _round_robin_gather(group, cp_rank: int, cp_size: int, num_tokens: int):
    """Prefill CP's output all-gather: rank ``r`` computed tokens ``r, r + cp, ...``."""
    per_rank = -(-num_tokens // cp_size)

    def gather(own: torch.Tensor) -> torch.Tensor:
        padded = own.new_zeros(per_rank, *own.shape[1:])
        padded[: own.shape[0]] = own
        parts = [torch.empty_like(padded) for _ in range(cp_size)]
        dist.all_gather(parts, padded, group=group)
        stacked = torch.stack(parts, dim=1).reshape(per_rank * cp_size, *own.shape[1:])
        return stacked[:num_tokens]  # row i*cp + r is rank r's i-th token = token i*cp + r

    return gather


@dataclass
class TwinRank:
    """One rank's view of the twin: config, batch, CP group and position."""

    config: SparseMLAConfig
    spec: TwinBatchSpec
    group: Any
    cp_rank: int
    cp_size: int
    device: Any = "cpu"
    pool_factory: Callable[[SparseMLAConfig, int, Any], Any] = ReferenceNSAPool

    def __post_init__(self) -> None:
        self.batch = build_twin_batch(self.config, self.spec, self.cp_size, self.device)
        self.weights = random_weights(self.config, self.spec.seed + 1, self.device)
        self.layout = CpSharedKVLayout(self.cp_size, self.cp_rank, self.config.page_size)
        own = torch.arange(self.cp_rank, len(self.batch.out_cache_loc), self.cp_size, device=self.device)
        self.own_tokens = own
        self.queries = QueryTokens(rows=self.batch.token_rows[own], positions=self.batch.token_positions[own])

    def _forward(self, pool, backend, indexer_cls, model_cls) -> torch.Tensor:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        b = self.batch
        gather = _round_robin_gather(self.group, self.cp_rank, self.cp_size, len(b.out_cache_loc))
        model = model_cls(self.config, self.weights, indexer_cls(self.config, self.weights), backend, gather)
        forward_batch = TwinForwardBatch(
            forward_mode=ForwardMode.EXTEND,
            batch_size=len(b.seq_lens),
            req_to_token_pool=SimpleNamespace(req_to_token=b.req_to_token),
            req_pool_indices=torch.arange(len(b.seq_lens), device=self.device),
            seq_lens_cpu=torch.tensor(b.seq_lens),
            extend_prefix_lens_cpu=list(b.prefix_lens),
            out_cache_loc=b.out_cache_loc,
            token_to_kv_pool=pool,
            attn_backend=backend,
            query_tokens=self.queries,
        )
        backend.init_forward_metadata(forward_batch)
        out = model.forward(b.chunk_hidden, self.own_tokens, forward_batch)
        assert forward_batch.out_cache_loc is b.out_cache_loc, "logical out_cache_loc not restored"
        return out

    def replicated_pool(self) -> Any:
        num_logical_pages = self.cp_size * (self.spec.physical_pages + 1)
        return self.pool_factory(self.config, (num_logical_pages - 1) * self.config.page_size, self.device)

    def run_replicated(self) -> tuple[torch.Tensor, Any]:
        pool = self.replicated_pool()
        store_prefix(pool, self.batch.prefix_locs, self.batch.prefix_kv, self.batch.prefix_index_k, self.config)
        out = self._forward(pool, ReferenceNSABackend(self.config), ReferenceIndexer, ReferenceSparseMLAModel)
        return out, pool

    def run_shared(
        self, strategy: str, prefetch: bool, side_stream: Optional[Any] = None
    ) -> tuple[torch.Tensor, Any]:
        pool = self.pool_factory(self.config, self.spec.physical_pages * self.config.page_size, self.device)
        physical = translate_out_cache_loc(self.layout, self.batch.prefix_locs)
        store_prefix(pool, physical, self.batch.prefix_kv, self.batch.prefix_index_k, self.config)
        backend = HookedBackend(self.config)
        setattr(
            backend,
            hooks.RUNTIME_ATTR,
            hooks.CpSharedKVRuntime(self.layout, self.group, strategy, prefetch, side_stream),
        )
        out = self._forward(pool, backend, HookedIndexer, HookedModel)
        return out, pool

    def owned_pages_only(self, shared: Any, replicated: Any) -> List[str]:
        """Problems with ``shared``: a non-padding page it should not hold, or an owned
        page whose bytes differ from the replicated pool's."""
        ps, problems = self.config.page_size, []
        locs = torch.unique(torch.cat([self.batch.prefix_locs, self.batch.out_cache_loc]))
        owned = locs[self.layout.owned_mask(locs)]
        physical = self.layout.logical_locs_to_physical(owned)
        batch_pages = set(np.unique((physical // ps).cpu().numpy()).tolist())
        for layer in range(self.config.num_layers):
            pages = shared.kv_buffer[layer].view(-1, ps * self.config.kv_cache_dim)
            nonzero = set(torch.nonzero(pages[1:].abs().sum(dim=1)).flatten().add(1).tolist())
            if not nonzero <= batch_pages:
                problems.append(f"layer {layer}: holds pages it does not own: {sorted(nonzero - batch_pages)}")
            if not torch.equal(shared.kv_buffer[layer][physical], replicated.kv_buffer[layer][owned]):
                problems.append(f"layer {layer}: owned KV differs from replicated KV")
            physical_pages = torch.tensor(sorted(batch_pages), device=shared.index_k_with_scale_buffer[layer].device)
            shared_index = shared.index_k_with_scale_buffer[layer][physical_pages]
            logical_pages = self.layout.physical_pages_to_logical(physical_pages)
            if not torch.equal(shared_index, replicated.index_k_with_scale_buffer[layer][logical_pages]):
                problems.append(f"layer {layer}: owned index K differs from replicated index K")
        return problems


@dataclass(frozen=True)
class TwinResult:
    """One shared-KV variant against the replicated reference, on one rank."""

    strategy: str
    prefetch: bool
    identical: bool
    max_abs_diff: float
    pool_problems: tuple
    seconds: float


def compare_shared_to_replicated(
    twin: TwinRank, variants: List[tuple], side_stream: Optional[Any] = None
) -> List[TwinResult]:
    """Run the replicated reference once, then each ``(strategy, prefetch)`` variant."""
    import time

    reference, replicated_pool = twin.run_replicated()
    results = []
    for strategy, prefetch in variants:
        start = time.perf_counter()
        out, shared_pool = twin.run_shared(strategy, prefetch, side_stream)
        seconds = time.perf_counter() - start
        results.append(
            TwinResult(
                strategy=strategy,
                prefetch=prefetch,
                identical=bool(torch.equal(out, reference)),
                max_abs_diff=float((out.float() - reference.float()).abs().max()),
                pool_problems=tuple(twin.owned_pages_only(shared_pool, replicated_pool)),
                seconds=seconds,
            )
        )
    return results
