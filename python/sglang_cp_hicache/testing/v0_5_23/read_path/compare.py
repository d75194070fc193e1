"""A sharded read-path forward against its replicated twin: per-layer matches, read coverage,
block-table problems."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Tuple

import torch

from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatch
from sglang_cp_hicache.testing.v0_5_23.read_path.formats import DSA_PAGE_SIZE
from sglang_cp_hicache.testing.v0_5_23.read_path.model import ForwardRecord


# -------------------------------------------------------------------- comparison
@dataclass(frozen=True)
class LayerMatch:
    layer: int
    topk_equal: bool
    index_read_equal: bool
    attention_equal: bool
    attention_max_abs_diff: float


@dataclass(frozen=True)
class ReadCoverage:
    """What the reference's top-k made attention read, over all layers (a comparison of
    reads that never touch the gathered prefix would prove nothing)."""

    query_rows: int  # this rank's real query tokens
    prefix_selections: int  # selected positions inside the request's cached prefix
    shared_page_selections: int  # ... inside the pages request 1 shares with request 0
    chunk_selections: int  # selected positions in the current chunk


def read_coverage(record: ForwardRecord, batch: ReadPathBatch, shared_tokens: int) -> ReadCoverage:
    requests = record.query_requests
    prefix_len = torch.tensor(batch.prefix_lens)[requests][:, None]
    prefix = chunk = shared = 0
    for topk in record.topk:
        selected = topk[: requests.numel()].long()
        valid = selected >= 0
        in_prefix = valid & (selected < prefix_len)
        prefix += int(in_prefix.sum())
        chunk += int((valid & ~in_prefix).sum())
        shared += int((in_prefix & (selected < shared_tokens))[requests == 1].sum())
    return ReadCoverage(requests.numel(), prefix, shared, chunk)


@dataclass(frozen=True)
class ReadPathComparison:
    """A sharded extend against the replicated reference on one rank."""

    layers: Tuple[LayerMatch, ...]
    hidden_equal: bool
    hidden_max_abs_diff: float
    table_translated: bool  # the kernel read scratch rows, not the logical table
    pool_problems: Tuple[str, ...]  # owned-rows check of the sharded pool after the extend
    coverage: ReadCoverage
    block_table_problems: Tuple[str, ...] = ()  # the sharded block table vs its token table

    @property
    def identical(self) -> bool:
        return self.hidden_equal and all(
            m.topk_equal and m.index_read_equal and m.attention_equal for m in self.layers
        )

    def differing_layers(self, what: str) -> Tuple[int, ...]:
        """Layers whose ``what`` (``topk``, ``index_read`` or ``attention``) differs."""
        return tuple(m.layer for m in self.layers if not getattr(m, f"{what}_equal"))


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.shape != b.shape:
        return float("inf")
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0


def _layer_match(layer: int, sharded: ForwardRecord, reference: ForwardRecord) -> LayerMatch:
    ours, theirs = sharded.index_reads[layer], reference.index_reads[layer]
    return LayerMatch(
        layer=layer,
        topk_equal=torch.equal(sharded.topk[layer], reference.topk[layer]),
        index_read_equal=torch.equal(ours.keys, theirs.keys)
        and torch.equal(ours.scales, theirs.scales),
        attention_equal=torch.equal(sharded.attention[layer], reference.attention[layer]),
        attention_max_abs_diff=_max_abs_diff(sharded.attention[layer], reference.attention[layer]),
    )


def block_table_problems(record: ForwardRecord) -> List[str]:
    """The 64-token block table the backend derives from the (translated) token table
    (``real_page_table``, ``_transform_table_1_to_real``) names the same rows: token ``j``
    of row ``i`` is row ``block[i, j // 64] * 64 + j % 64`` for ``j`` below its sequence
    length (columns past it hold stale locs). A translation that split a logical page over
    two scratch blocks would break the block view ``flashmla_kv`` reads."""
    table, blocks = record.page_table_1.long(), record.real_page_table.long()
    columns = torch.arange(table.shape[1])
    expected = blocks[:, columns // DSA_PAGE_SIZE] * DSA_PAGE_SIZE + columns % DSA_PAGE_SIZE
    live = columns[None, :] < record.table_seq_lens.long()[:, None]
    rows = torch.nonzero(((table != expected) & live).any(dim=1)).flatten().tolist()
    return [f"row {i}: token table and 64-token block table disagree" for i in rows]


def compare(
    sharded: ForwardRecord,
    reference: ForwardRecord,
    pool_problems: List[str],
    coverage: ReadCoverage,
) -> ReadPathComparison:
    return ReadPathComparison(
        layers=tuple(_layer_match(i, sharded, reference) for i in range(len(reference.attention))),
        hidden_equal=torch.equal(sharded.hidden, reference.hidden),
        hidden_max_abs_diff=_max_abs_diff(sharded.hidden, reference.hidden),
        table_translated=not torch.equal(sharded.page_table_1, reference.page_table_1),
        pool_problems=tuple(pool_problems),
        coverage=coverage,
        block_table_problems=tuple(block_table_problems(sharded)),
    )
