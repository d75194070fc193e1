"""One CP rank of the read path: ReadPathRank runs the sharded and the replicated forward
and compares them; read_path_session sets up its stand-ins and context."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import (
    SparseMLAConfig,
    quantize_index_k,
    random_weights,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.batch import (
    ReadPathBatch,
    ReadPathBatchSpec,
    build_batch,
    split_batch,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.compare import (
    ReadPathComparison,
    compare,
    read_coverage,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.context import publish_runtime_context
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import (
    DsaKvFormat,
    FLASHMLA_SPARSE_BF16,
    READ_PATH_CONFIG,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns
from sglang_cp_hicache.testing.v0_5_23.read_path.model import ForwardRecord, ReadPathModel
from sglang_cp_hicache.testing.v0_5_23.read_path.pools import (
    ReadPathPools,
    build_backend,
    owned_rows_problems,
)
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup


# ------------------------------------------------------------------------ one rank
@dataclass
class ReadPathRank:
    """One prefill-CP rank's runs: the batch, weights and layers (identical on every
    rank), a replicated reference computed once, and sharded extends to compare with it.

    Invariant: ``shard_group`` is the attention-CP group (upstream's ``get_kv_shard_group``
    picks CP first), so the shard rank is the CP rank. Build it inside
    :func:`read_path_session`, which publishes the runtime context it reads.
    """

    shard_group: GlooShardGroup
    model_config: Any  # the published DSA ModelConfig
    spec: ReadPathBatchSpec = ReadPathBatchSpec()
    config: SparseMLAConfig = READ_PATH_CONFIG
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16  # must be the published one
    draft_worker: bool = False  # the MTP draft's layer (:meth:`draft`)

    def __post_init__(self) -> None:
        from sglang.srt.layers.radix_attention import RadixAttention

        c = self.config
        if c != dataclasses.replace(self.kv_format.config, num_layers=c.num_layers):
            raise ValueError(f"ReadPathRank: {self.kv_format.name} runs {self.kv_format.config}")
        self.batch = build_batch(c, self.spec, self.shard_group.world_size)
        self.pools = ReadPathPools(c, self.spec, self.shard_group, self.kv_format)
        self.layers = [
            RadixAttention(
                c.num_heads,
                c.kv_cache_dim,
                scaling=1.0 / math.sqrt(c.kv_cache_dim),
                num_kv_heads=1,
                layer_id=layer_id,
                v_head_dim=c.kv_lora_rank,
            )
            for layer_id in range(c.num_layers)
        ]
        self.model = ReadPathModel(c, random_weights(c, self.spec.seed + 1, "cpu"), self.layers)
        self._reference: Optional[Tuple[ForwardRecord, Any]] = None

    def with_spec(self, spec: ReadPathBatchSpec) -> "ReadPathRank":
        """This rank over another batch, in the same published context."""
        published = (self.spec.context_len, self.spec.chunked_prefill_size)
        if (spec.context_len, spec.chunked_prefill_size) != published:
            raise ValueError("with_spec: the published context and chunk sizes must not change")
        return ReadPathRank(
            self.shard_group,
            self.model_config,
            spec,
            self.config,
            self.kv_format,
            self.draft_worker,
        )

    def draft(self) -> "ReadPathRank":
        """The EAGLE MTP draft's extend on a PD prefill worker, twinned: the batch's forward
        mode stays EXTEND (``eagle_worker_v2._draft_extend_for_prefill``), so the draft's
        DSA backend reads with the *prefill* kernel (``dsa_backend.py:1129-1138, 2186-2193``)
        over the draft's own sharded pool, which upstream builds with the target's shard
        spec and group and its own buffers, scratch and gather (``_build_mtp_kv_shard_pool``,
        ``kv_cache_configurator.py:1922``): one NextN layer, layer id 0, same batch."""
        return ReadPathRank(
            self.shard_group,
            self.model_config,
            self.spec,
            dataclasses.replace(self.config, num_layers=1),
            self.kv_format,
            draft_worker=True,
        )

    def store_prefix(self, pool: Any) -> None:
        """An earlier extend's KV and index K of the prefix, through the pool's own
        writes (outside an extend the sharded pool persists only its owned rows)."""
        b, r = self._stored_batch(), self.config.kv_lora_rank
        for layer_id, layer in enumerate(self.layers):
            kv = b.prefix_kv[layer_id][:, None, :]
            pool.set_mla_kv_buffer(layer, b.prefix_locs, kv[..., :r], kv[..., r:])
            index_k, scale = quantize_index_k(b.prefix_index_key[layer_id])
            pool.set_index_k_scale_buffer(layer_id, b.prefix_locs, index_k, scale)

    def _stored_batch(self) -> ReadPathBatch:
        """The batch whose prefix :meth:`store_prefix` writes (on the pools' device)."""
        return self.batch

    def run(self, pool: Any) -> ForwardRecord:
        """Store the prefix in ``pool``, then run the extend through a backend over it."""
        self.store_prefix(pool)
        return self.model.forward(self._backend(pool), pool, self.batch)

    def _backend(self, pool: Any) -> Any:
        return build_backend(
            pool, self.batch, self.model_config, self.config, self.kv_format, self.draft_worker
        )

    def run_chunked(self, pool: Any, first_extend_lens: Tuple[int, ...]) -> List[ForwardRecord]:
        """Store the cached prefix, then the extend as two chunks through one backend
        (:func:`split_batch`): the second chunk's prefix includes what the first wrote."""
        self.store_prefix(pool)
        backend = self._backend(pool)
        chunks = split_batch(self.batch, first_extend_lens)
        return [self.model.forward(backend, pool, chunk) for chunk in chunks]

    def reference(self) -> Tuple[ForwardRecord, Any]:
        """The replicated run (record, pool), computed once."""
        if self._reference is None:
            pool = self.pools.replicated()
            self._reference = (self.run(pool), pool)
        return self._reference

    def compare_sharded_to_replicated(self) -> ReadPathComparison:
        """A sharded extend on a fresh pool against the replicated reference."""
        reference, replicated = self.reference()
        sharded = self.pools.sharded()
        record = self.run(sharded)
        locs = torch.unique(torch.cat([self.batch.prefix_locs, self.batch.out_cache_loc]))
        shared_tokens = self.spec.shared_prefix_pages * self.config.page_size
        return compare(
            record,
            reference,
            owned_rows_problems(sharded, replicated, locs),
            read_coverage(reference, self.batch, shared_tokens),
        )

    def compare_chunked_to_replicated(
        self, first_extend_lens: Tuple[int, ...]
    ) -> Tuple[ReadPathComparison, ...]:
        """A chunked prefill (two extends, fresh pools) against its replicated twin: one
        comparison per chunk. The pool check covers every loc of both chunks."""
        replicated, sharded = self.pools.replicated(), self.pools.sharded()
        references = self.run_chunked(replicated, first_extend_lens)
        records = self.run_chunked(sharded, first_extend_lens)
        locs = torch.unique(torch.cat([self.batch.prefix_locs, self.batch.out_cache_loc]))
        problems = owned_rows_problems(sharded, replicated, locs)
        shared_tokens = self.spec.shared_prefix_pages * self.config.page_size
        return tuple(
            compare(record, reference, problems, read_coverage(reference, chunk, shared_tokens))
            for record, reference, chunk in zip(
                records, references, split_batch(self.batch, first_extend_lens)
            )
        )


@contextlib.contextmanager
def read_path_session(
    shard_group: GlooShardGroup,
    spec: ReadPathBatchSpec = ReadPathBatchSpec(),
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16,
) -> Iterator[ReadPathRank]:
    """This rank's runtime context, stand-ins and :class:`ReadPathRank` in ``kv_format``.
    Every rank of ``shard_group`` must enter it and then run the same extends in the same
    order (the prefix gathers are collectives).

    ``SGLANG_DEBUG_MEMORY_POOL`` is on, so ``begin_shard_extend`` also checks that every
    prefix's owners are cyclic (the batch's construction invariant).
    ``SGLANG_DSA_FUSE_TOPK`` is off: the torch top-k backend has no fused transform
    (``dsa_topk_backend.py:269``).
    """
    from sglang.srt.environ import envs

    with envs.SGLANG_DEBUG_MEMORY_POOL.override(True), envs.SGLANG_DSA_FUSE_TOPK.override(False):
        with CpuKernelStandIns(shard_group.cpu_group):
            config = kv_format.config
            model_config = publish_runtime_context(config, spec, shard_group, kv_format)
            yield ReadPathRank(shard_group, model_config, spec, config, kv_format)
