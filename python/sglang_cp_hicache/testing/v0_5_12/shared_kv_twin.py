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

Then the MTP draft (``TwinBatchSpec.draft_layers`` layers, 1 like NextN) runs its prefill
extend the way SGLang's EAGLE worker does on the prefill server: an EXTEND batch with the
target's ``req_to_token``, prefix and ``out_cache_loc`` (one logical allocator), its own
pool (replicated, or physical and owner-only under shared KV), its own backend and
indexer, wrapped by the same hooks. Its input is computed from the target's gathered
output on the full chunk on every rank (upstream's NextN embeds and projects the whole
chunk, then prefill CP splits the queries). Its output and pool are checked like the
target's, and :func:`same_physical_slots` checks that the draft pool holds exactly the
physical slots the target pool holds (the same logical loc lands on the same slot).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Callable, List, Optional

import numpy as np
import torch
import torch.distributed as dist

from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_write import translate_out_cache_loc
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
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout


@dataclass(frozen=True)
class TwinBatchSpec:
    prefix_lens: tuple = (37, 24, 0)
    extend_lens: tuple = (11, 9, 7)
    shared_prefix_pages: int = 2  # request 1 reuses request 0's first pages (radix hit)
    physical_pages: int = 40  # per rank, padding page excluded
    seed: int = 0
    draft_layers: int = 1  # the MTP draft's layers (NextN: 1); 0 runs the target only


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
    draft_prefix_kv: List[torch.Tensor]  # an earlier draft extend's KV of the same prefix
    draft_prefix_index_k: List[torch.Tensor]


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
        draft_prefix_kv=[randn(len(prefix_locs), config.kv_cache_dim) for _ in range(spec.draft_layers)],
        draft_prefix_index_k=[randn(len(prefix_locs), config.index_head_dim) for _ in range(spec.draft_layers)],
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


class HookedDraftModel(ReferenceSparseMLAModel):
    """The draft model: its own class with its own hooked ``forward``, as SGLang's
    ``DeepseekV3ForCausalLMNextN`` overrides ``DeepseekV2ForCausalLM.forward``."""

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


def draft_input(target_out: torch.Tensor, chunk_hidden: torch.Tensor) -> torch.Tensor:
    """Stands for NextN's ``eh_proj(enorm(embed(next tokens)), hnorm(target hidden))``:
    the target's gathered output combined with the next token's embedding, on the full
    chunk, identical on every rank."""
    return target_out + chunk_hidden.roll(-1, dims=0)


@dataclass(frozen=True)
class TwinOutputs:
    """One run (replicated or shared): final hidden states and pools, target and draft."""

    target: torch.Tensor
    target_pool: Any
    draft: Optional[torch.Tensor] = None
    draft_pool: Any = None


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
        self.draft_config = dataclasses.replace(self.config, num_layers=self.spec.draft_layers)
        self.draft_weights = random_weights(self.draft_config, self.spec.seed + 2, self.device)
        self.layout = CpSharedKVLayout(self.cp_size, self.cp_rank, self.config.page_size)
        own = torch.arange(self.cp_rank, len(self.batch.out_cache_loc), self.cp_size, device=self.device)
        self.own_tokens = own
        self.queries = QueryTokens(rows=self.batch.token_rows[own], positions=self.batch.token_positions[own])

    @property
    def has_draft(self) -> bool:
        return self.spec.draft_layers > 0

    def _forward(self, pool, backend, indexer_cls, model_cls, hidden, config, weights) -> torch.Tensor:
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        b = self.batch
        gather = _round_robin_gather(self.group, self.cp_rank, self.cp_size, len(b.out_cache_loc))
        model = model_cls(config, weights, indexer_cls(config, weights), backend, gather)
        # The draft's prefill extend is an EXTEND batch over the target's logical locs.
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
        out = model.forward(hidden, self.own_tokens, forward_batch)
        assert forward_batch.out_cache_loc is b.out_cache_loc, "logical out_cache_loc not restored"
        return out

    def _pool(self, config: SparseMLAConfig, tokens: int) -> Any:
        return self.pool_factory(config, tokens, self.device)

    def replicated_pool(self, config: Optional[SparseMLAConfig] = None) -> Any:
        num_logical_pages = self.cp_size * (self.spec.physical_pages + 1)
        return self._pool(config or self.config, (num_logical_pages - 1) * self.config.page_size)

    def _shared_backend(self, strategy: str, prefetch: bool, side_stream: Optional[Any]) -> "HookedBackend":
        """A backend with its own runtime over this rank's layout, as each model runner's
        NSA backend resolves one (target and draft alike)."""
        backend = HookedBackend(self.config)
        setattr(
            backend,
            hooks.RUNTIME_ATTR,
            hooks.CpSharedKVRuntime(self.layout, self.group, strategy, prefetch, side_stream),
        )
        return backend

    def run_replicated(self) -> TwinOutputs:
        b = self.batch
        pool = self.replicated_pool()
        store_prefix(pool, b.prefix_locs, b.prefix_kv, b.prefix_index_k, self.config)
        out = self._forward(
            pool, ReferenceNSABackend(self.config), ReferenceIndexer, ReferenceSparseMLAModel,
            b.chunk_hidden, self.config, self.weights,
        )
        if not self.has_draft:
            return TwinOutputs(out, pool)
        draft_pool = self.replicated_pool(self.draft_config)
        store_prefix(draft_pool, b.prefix_locs, b.draft_prefix_kv, b.draft_prefix_index_k, self.draft_config)
        draft = self._forward(
            draft_pool, ReferenceNSABackend(self.draft_config), ReferenceIndexer, ReferenceSparseMLAModel,
            draft_input(out, b.chunk_hidden), self.draft_config, self.draft_weights,
        )
        return TwinOutputs(out, pool, draft, draft_pool)

    def run_shared(self, strategy: str, prefetch: bool, side_stream: Optional[Any] = None) -> TwinOutputs:
        b = self.batch
        physical = translate_out_cache_loc(self.layout, b.prefix_locs)
        pool = self._pool(self.config, self.spec.physical_pages * self.config.page_size)
        store_prefix(pool, physical, b.prefix_kv, b.prefix_index_k, self.config)
        out = self._forward(
            pool, self._shared_backend(strategy, prefetch, side_stream), HookedIndexer, HookedModel,
            b.chunk_hidden, self.config, self.weights,
        )
        if not self.has_draft:
            return TwinOutputs(out, pool)
        # Same physical size as the target's pool (memory_pool_config), same layout.
        draft_pool = self._pool(self.draft_config, self.spec.physical_pages * self.config.page_size)
        store_prefix(draft_pool, physical, b.draft_prefix_kv, b.draft_prefix_index_k, self.draft_config)
        draft = self._forward(
            draft_pool, self._shared_backend(strategy, prefetch, side_stream), HookedIndexer, HookedDraftModel,
            draft_input(out, b.chunk_hidden), self.draft_config, self.draft_weights,
        )
        return TwinOutputs(out, pool, draft, draft_pool)

    def owned_pages_only(self, shared: Any, replicated: Any) -> List[str]:
        """Problems with ``shared`` (target or draft pool): a non-padding page it should
        not hold, or an owned page whose bytes differ from the replicated pool's."""
        ps, problems = self.config.page_size, []
        locs = torch.unique(torch.cat([self.batch.prefix_locs, self.batch.out_cache_loc]))
        owned = locs[self.layout.owned_mask(locs)]
        physical = self.layout.logical_locs_to_physical(owned)
        batch_pages = set(np.unique((physical // ps).cpu().numpy()).tolist())
        for layer in range(len(shared.kv_buffer)):
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


def written_slots(pool: Any) -> torch.Tensor:
    """Physical token slots of layer 0 holding data, padding page excluded (sorted)."""
    rows = pool.kv_buffer[0].flatten(1).abs().sum(dim=1)
    rows[: pool.page_size] = 0
    return torch.nonzero(rows).flatten()


def same_physical_slots(target_pool: Any, draft_pool: Any) -> List[str]:
    """Problems unless the draft pool holds data at exactly the target pool's physical
    slots: one logical allocator, one layout, so a logical loc names one slot in both."""
    target, draft = written_slots(target_pool), written_slots(draft_pool)
    if torch.equal(target, draft):
        return []
    only_draft = sorted(set(draft.tolist()) - set(target.tolist()))
    only_target = sorted(set(target.tolist()) - set(draft.tolist()))
    return [f"draft slots differ from target slots: draft only {only_draft[:8]}, target only {only_target[:8]}"]


@dataclass(frozen=True)
class TwinResult:
    """One shared-KV variant against the replicated reference, on one rank."""

    strategy: str
    prefetch: bool
    identical: bool
    max_abs_diff: float
    pool_problems: tuple
    seconds: float
    draft_identical: Optional[bool] = None  # None: no draft in the twin
    draft_max_abs_diff: Optional[float] = None
    draft_pool_problems: tuple = ()


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max())


def compare_shared_to_replicated(
    twin: TwinRank, variants: List[tuple], side_stream: Optional[Any] = None
) -> List[TwinResult]:
    """Run the replicated reference once, then each ``(strategy, prefetch)`` variant."""
    import time

    reference = twin.run_replicated()
    results = []
    for strategy, prefetch in variants:
        start = time.perf_counter()
        shared = twin.run_shared(strategy, prefetch, side_stream)
        seconds = time.perf_counter() - start
        draft = {}
        if twin.has_draft:
            draft = dict(
                draft_identical=bool(torch.equal(shared.draft, reference.draft)),
                draft_max_abs_diff=_max_abs_diff(shared.draft, reference.draft),
                draft_pool_problems=tuple(
                    twin.owned_pages_only(shared.draft_pool, reference.draft_pool)
                    + same_physical_slots(shared.target_pool, shared.draft_pool)
                ),
            )
        results.append(
            TwinResult(
                strategy=strategy,
                prefetch=prefetch,
                identical=bool(torch.equal(shared.target, reference.target)),
                max_abs_diff=_max_abs_diff(shared.target, reference.target),
                pool_problems=tuple(twin.owned_pages_only(shared.target_pool, reference.target_pool)),
                seconds=seconds,
                **draft,
            )
        )
    return results
