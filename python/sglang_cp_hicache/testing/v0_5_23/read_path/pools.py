"""The read path's pools (upstream's sharded PageInterleaveDSATokenToKVPool and the
unsharded DSATokenToKVPool), the owned-rows check between them, and the real
DeepseekSparseAttnBackend built over a pool."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, List

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatch, ReadPathBatchSpec
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import DsaKvFormat, FLASHMLA_SPARSE_BF16
from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup


# ------------------------------------------------------------------ pools, backend
@dataclass(frozen=True)
class ReadPathPools:
    """Builds one rank's two pools over the same logical space: the replicated reference
    and the sharded stripe (fresh ones per run, so one run's scratch never leaks into the
    next)."""

    config: SparseMLAConfig
    spec: ReadPathBatchSpec
    shard_group: GlooShardGroup
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16

    def _kwargs(self) -> dict:
        c = self.config
        return dict(
            page_size=c.page_size,
            kv_lora_rank=c.kv_lora_rank,
            dtype=self.kv_format.pool_dtype,
            qk_rope_head_dim=c.qk_rope_head_dim,
            layer_num=c.num_layers,
            device="cpu",
            index_head_dim=c.index_head_dim,
            enable_memory_saver=False,
            kv_cache_dim=self.kv_format.pool_kv_cache_dim,
        )

    def replicated(self) -> Any:
        """Every logical page at its logical loc: all ranks' rows plus the reserved
        pages, so the largest logical loc is in range."""
        from sglang.srt.mem_cache.memory_pool import DSATokenToKVPool

        ps, size = self.config.page_size, self.shard_group.world_size
        return DSATokenToKVPool(size * (self.spec.pages_per_rank + 1) * ps - ps, **self._kwargs())

    def sharded(self) -> Any:
        """This rank's stripe; the scratch sized as upstream's ``make_page_shard_spec``
        sizes it (eight contexts, each rounded up to a gather span)."""
        from sglang.srt.mem_cache.page_interleave import (
            _KV_SHARD_SCRATCH_PREFIX_CONTEXTS,
            PageShardSpec,
        )
        from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveDSATokenToKVPool

        ps, group = self.config.page_size, self.shard_group
        span = group.world_size * ps
        spec = PageShardSpec(
            shard_rank=group.rank_in_group,
            shard_size=group.world_size,
            page_size=ps,
            max_prefix_tokens=_KV_SHARD_SCRATCH_PREFIX_CONTEXTS
            * (-(-self.spec.context_len // span) * span),
            chunk_tokens=-(-self.spec.chunked_prefill_size // ps) * ps,
        )
        return PageInterleaveDSATokenToKVPool(
            self.spec.pages_per_rank * ps, shard_spec=spec, shard_group=group, **self._kwargs()
        )


def owned_rows_problems(sharded: Any, replicated: Any, logical_locs: torch.Tensor) -> List[str]:
    """The sharded pool holds, at the local row of each loc it owns among
    ``logical_locs``, the replicated pool's bytes, and nothing on pages it does not own
    (latent KV and index K)."""
    placement, rank, ps = sharded.placement, sharded.shard_rank, sharded.page_size
    owned = logical_locs[placement.local_mask(logical_locs, rank)]
    local = placement.local_index(owned)
    owned_pages = set((local // ps).tolist())
    logical_pages, local_pages = torch.unique(owned // ps), torch.unique(local // ps)
    problems = []
    for layer in range(sharded.layer_num):
        if not torch.equal(sharded.kv_buffer[layer][local], replicated.kv_buffer[layer][owned]):
            problems.append(f"layer {layer}: owned latent KV differs from the replicated pool")
        rows = sharded.kv_buffer[layer].flatten(1).float().abs().sum(dim=1)
        stray = set(torch.nonzero(rows.view(-1, ps).sum(dim=1)).flatten().tolist()) - owned_pages
        if stray:
            problems.append(f"layer {layer}: latent KV on pages it does not own: {sorted(stray)}")
        index_k = sharded.index_key_cache.buffer[layer]
        reference_index_k = replicated.index_key_cache.buffer[layer]
        if not torch.equal(index_k[local_pages], reference_index_k[logical_pages]):
            problems.append(f"layer {layer}: owned index K differs from the replicated pool")
        written = torch.nonzero(index_k.sum(dim=1, dtype=torch.int64)).flatten().tolist()
        stray = set(written) - owned_pages
        if stray:
            problems.append(f"layer {layer}: index K on pages it does not own: {sorted(stray)}")
    return problems


def build_backend(
    pool: Any,
    batch: ReadPathBatch,
    model_config: Any,
    config: SparseMLAConfig,
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16,
    is_draft_worker: bool = False,
) -> Any:
    """The real ``DeepseekSparseAttnBackend`` over ``pool``, built as on an H200. Its model
    runner is the bundle of attributes the constructor reads (a real ``ModelRunner``
    loads a model onto a GPU); ``req_to_token`` is a real ``ReqToTokenPool``'s. The
    sub-backends come from the published context (:func:`publish_runtime_context`).
    ``is_draft_worker``: the MTP draft's extend backend (``DraftBackendFactory``'s DSA
    prefill backend, ``speculative/draft_utils.py:214``) over the draft's own pool."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    num_reqs = len(batch.seq_lens)
    req_to_token_pool = ReqToTokenPool(
        size=num_reqs,
        max_context_len=batch.req_to_token.shape[1],
        device="cpu",
        enable_memory_saver=False,
    )
    req_to_token_pool.req_to_token[:num_reqs] = batch.req_to_token
    model_runner = SimpleNamespace(
        device="cpu",
        page_size=config.page_size,
        model_config=model_config,
        token_to_kv_pool=pool,
        req_to_token_pool=req_to_token_pool,
        is_draft_worker=is_draft_worker,
        hisparse_coordinator=None,
        kv_cache_dtype=kv_format.pool_dtype,
        max_running_requests=num_reqs,
    )
    with CpuKernelStandIns.hopper_capability():
        return DeepseekSparseAttnBackend(model_runner)
