"""The read path's model: StandInIndexer (upstream's indexer compute on CPU, reading
index K where upstream reads it) and ReadPathModel, which runs the real backend's
forward layer by layer and records what each layer read."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import (
    LayerWeights,
    SparseMLAConfig,
    dequantize_index_k,
    quantize_index_k,
)
from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatch


# ------------------------------------------------------------------------ indexer
@dataclass(frozen=True)
class IndexRead:
    """What the pool returned for one layer's index-K read (bytes, as the kernel sees)."""

    keys: torch.Tensor  # uint8 [seq_len_sum, 128]
    scales: torch.Tensor  # uint8 [seq_len_sum, 4]


class StandInIndexer:
    """The indexer's prefill top-k with torch compute, reading like ``Indexer``.

    Store: fp8 keys of the full chunk through ``pool.set_index_k_scale_buffer`` (the
    fallback of ``Indexer._store_index_k_cache``). Read: what ``_get_topk_ragged`` reads,
    ``pool.get_index_k_scale_buffer`` with the metadata's ``get_logical_page_table`` and
    indexer sequence lengths, ``ks``/``ke`` from ``get_indexer_kvcache_range``. Logits
    (``fp8_mqa_logits``'s job): ``sum_h gate_h * relu(q_h . k)``. Selection: the metadata's
    ``topk_transform`` (upstream's torch top-k over each query's causal window).
    """

    def __init__(self, config: SparseMLAConfig, weights: List[LayerWeights]):
        self.config = config
        self.weights = weights

    def forward(
        self,
        local_hidden: torch.Tensor,
        full_key: torch.Tensor,
        forward_batch: Any,
        backend: Any,
        pool: Any,
        layer_id: int,
    ) -> Tuple[torch.Tensor, IndexRead]:
        """``local_hidden``: this rank's (CP-padded) query rows; ``full_key``: the whole
        chunk's indexer keys. Returns top-k positions ``[rows, topk]`` (-1: none; padded
        rows all -1) and the index-K bytes the pool returned."""
        w = self.weights[layer_id]
        index_k, scale = quantize_index_k(full_key)
        pool.set_index_k_scale_buffer(layer_id, forward_batch.out_cache_loc, index_k, scale)
        metadata = backend.get_indexer_metadata(layer_id, forward_batch)
        ks, _ = metadata.get_indexer_kvcache_range()
        seq_lens_cpu = metadata.get_indexer_seq_len_cpu()
        keys, scales = pool.get_index_k_scale_buffer(
            layer_id,
            metadata.get_indexer_seq_len(),
            metadata.get_logical_page_table(),
            int(seq_lens_cpu.sum()),
            int(seq_lens_cpu.max()),
        )
        queries = local_hidden[: ks.shape[0]]  # real (unpadded) local tokens
        q_index = torch.einsum("nh,hid->nid", queries, w.w_index_q)
        gates = queries @ w.w_index_gate
        scores = torch.relu(torch.einsum("nid,kd->nik", q_index, dequantize_index_k(keys, scales)))
        logits = (scores * gates[:, :, None]).sum(dim=1)
        topk = torch.full((local_hidden.shape[0], self.config.index_topk), -1, dtype=torch.int32)
        topk[: ks.shape[0]] = metadata.topk_transform(logits, self.config.index_topk, ks=ks)
        return topk, IndexRead(keys.clone(), scales.clone())


# -------------------------------------------------------------------------- forward
@dataclass
class ForwardRecord:
    """Everything one rank read and produced in one extend, per layer."""

    topk: List[torch.Tensor] = field(default_factory=list)  # positions in each sequence
    index_reads: List[IndexRead] = field(default_factory=list)
    attention: List[torch.Tensor] = field(default_factory=list)  # forward_extend outputs
    page_table_1: Optional[torch.Tensor] = None  # the table the attention kernel read
    real_page_table: Optional[torch.Tensor] = None  # its 64-token block table
    table_seq_lens: Optional[torch.Tensor] = None  # sequence length of each table row
    hidden: Optional[torch.Tensor] = None  # final hidden states, gathered (token order)
    query_requests: Optional[torch.Tensor] = None  # request of each local query row


def extend_forward_batch(batch: ReadPathBatch) -> Any:
    """The ``ForwardBatch`` a scheduler would build for this EXTEND (``input_ids`` only
    set for its length: prefill CP's ``can_apply`` counts it)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    extend_lens = [s - p for p, s in zip(batch.prefix_lens, batch.seq_lens)]
    num_tokens = len(batch.out_cache_loc)
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=len(batch.seq_lens),
        input_ids=torch.zeros(num_tokens, dtype=torch.int64),
        req_pool_indices=torch.arange(len(batch.seq_lens), dtype=torch.int64),
        seq_lens=torch.tensor(batch.seq_lens, dtype=torch.int64),
        out_cache_loc=batch.out_cache_loc.clone(),
        seq_lens_sum=sum(batch.seq_lens),
        seq_lens_cpu=torch.tensor(batch.seq_lens, dtype=torch.int64),
        extend_num_tokens=num_tokens,
        extend_seq_lens=torch.tensor(extend_lens, dtype=torch.int32),
        extend_seq_lens_cpu=extend_lens,
        extend_prefix_lens=torch.tensor(batch.prefix_lens, dtype=torch.int32),
        extend_prefix_lens_cpu=list(batch.prefix_lens),
        positions=torch.cat(
            [torch.arange(p, s) for p, s in zip(batch.prefix_lens, batch.seq_lens)]
        ),
    )


class ReadPathModel:
    """The DSA layer loop of one prefill-CP rank (DeepseekV2's absorbed MLA under CP
    interleave): queries for this rank's tokens; latent KV and indexer keys gathered to
    the full chunk before the pool writes; the output gathered at the end."""

    def __init__(self, config: SparseMLAConfig, weights: List[LayerWeights], layers: List[Any]):
        self.config = config
        self.weights = weights
        self.layers = layers
        self.indexer = StandInIndexer(config, weights)

    def forward(self, backend, pool, batch: ReadPathBatch) -> ForwardRecord:
        from sglang.srt.layers.cp.base import get_cp_strategy
        from sglang.srt.layers.cp.utils import prepare_cp_forward

        c, r = self.config, self.config.kv_lora_rank
        strategy = get_cp_strategy()
        forward_batch = self._forward_batch(batch)
        prepare_cp_forward(forward_batch)
        backend.init_forward_metadata(forward_batch)
        metadata = backend.forward_metadata
        record = ForwardRecord(
            page_table_1=metadata.page_table_1.clone(),
            real_page_table=metadata.real_page_table.clone(),
            table_seq_lens=metadata.indexer_seq_lens_cpu.clone(),
        )
        record.query_requests = strategy.shard_local_tokens(batch.chunk_requests)
        local = strategy.shard_hidden_states(batch.chunk_hidden, forward_batch)
        for layer_id, w in enumerate(self.weights):
            full_key = strategy.gather_kv_cache((local @ w.w_index_k).contiguous(), forward_batch)
            topk, index_read = self.indexer.forward(
                local, full_key, forward_batch, backend, pool, layer_id
            )
            latent = torch.cat([local @ w.w_kv, local @ w.w_k_rope], dim=-1).to(c.kv_dtype)
            full_latent = strategy.gather_kv_cache(latent.contiguous(), forward_batch)[:, None, :]
            out = backend.forward_extend(
                torch.einsum("nh,hgr->ngr", local, w.w_q_nope).to(c.kv_dtype),
                full_latent[..., :r],
                full_latent[..., :r],
                self.layers[layer_id],
                forward_batch,
                q_rope=torch.einsum("nh,hgr->ngr", local, w.w_q_rope).to(c.kv_dtype),
                k_rope=full_latent[..., r:],
                topk_indices=topk,
            )
            record.topk.append(topk)
            record.index_reads.append(index_read)
            record.attention.append(out.clone())
            local = local + out.float().reshape(out.shape[0], -1) @ w.w_out
        record.hidden = strategy.gather_hidden_states(local, forward_batch)
        return self._finished(record)

    def _forward_batch(self, batch: ReadPathBatch) -> Any:
        """The forward batch the layers run on (the CPU runtime's device here)."""
        return extend_forward_batch(batch)

    def _finished(self, record: ForwardRecord) -> ForwardRecord:
        """The record as the comparison reads it."""
        return record
