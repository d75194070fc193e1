"""What 0.5.23's sharded DSA pool charges for its prefix-gather scratch, per rank.

Upstream sizes the scratch from a fixed budget, whatever the workload
(``mem_cache/page_interleave.py``): ``make_page_shard_spec`` provisions
``_KV_SHARD_SCRATCH_PREFIX_CONTEXTS`` (8) full contexts, each rounded up to a gather span
(``shard_size x page``), plus the chunk and a trash page per slot (``PageShardSpec.
scratch_rows``); ``compute_page_shard_scratch_bytes`` charges two slots (double-buffered, ONE
layer each) times the row bytes, doubled when one EAGLE MTP runner is budgeted, and
``pool_configurator.py:252-257`` takes it off the KV budget before sizing the pool.

:func:`dsa_scratch_figure` reproduces that charge from a model's geometry without a GPU, for
the docs and the startup figure, using upstream's own ``PageShardSpec``; the row bytes follow
``_page_shard_row_bytes`` (the test checks both against upstream).
:func:`log_startup_scratch` logs, once per target rank at startup under the flag, the
charge of the live pool's own spec (``pool.shard_spec``, what ``make_page_shard_spec``
built for this server).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

logger = logging.getLogger(__name__)

GIB = 1024**3
DSA_PAGE_SIZE = 64
FP8_QUANT_BLOCK = 128  # one fp32 scale per 128 fp8 values (DSATokenToKVPool.quant_block_size)


@dataclass(frozen=True)
class DsaScratchGeometry:
    """The model dimensions the scratch row depends on (GLM-5 / DeepSeek-V3.2 defaults)."""

    kv_lora_rank: int = 512
    qk_rope_head_dim: int = 64
    index_head_dim: int = 128

    def row_bytes(self, kv_cache_dtype: str) -> int:
        """Bytes per scratch token row: latent KV in its stored format plus fp8 index K and
        its fp32 scales."""
        if kv_cache_dtype == "fp8_e4m3":  # packed: fp8 nope | fp32 scales | bf16 rope
            scales = self.kv_lora_rank // FP8_QUANT_BLOCK * 4
            kv = self.kv_lora_rank + scales + self.qk_rope_head_dim * 2
        elif kv_cache_dtype == "bfloat16":
            kv = (self.kv_lora_rank + self.qk_rope_head_dim) * 2
        else:
            raise ValueError(f"DSA KV is bfloat16 or fp8_e4m3, not {kv_cache_dtype}")
        return kv + self.index_head_dim + self.index_head_dim // FP8_QUANT_BLOCK * 4


@dataclass(frozen=True)
class DsaScratchFigure:
    """One rank's fixed scratch charge (independent of the rank and, past rounding, of cp)."""

    kv_cache_dtype: str
    context_len: int
    chunk_tokens: int
    shard_size: int
    rows_per_slot: int
    row_bytes: int
    with_mtp: bool

    @property
    def bytes(self) -> int:
        return 2 * self.rows_per_slot * self.row_bytes * (2 if self.with_mtp else 1)

    @property
    def gib(self) -> float:
        return self.bytes / GIB

    def line(self) -> str:
        return (
            f"KV-shard scratch: {self.gib:.2f} GiB per rank ({self.kv_cache_dtype}, context "
            f"{self.context_len}, chunk {self.chunk_tokens}, cp {self.shard_size}"
            f"{', MTP' if self.with_mtp else ''}: 2 slots x {self.rows_per_slot} rows x "
            f"{self.row_bytes} B)"
        )


def dsa_scratch_figure(
    *,
    kv_cache_dtype: str,
    context_len: int,
    chunked_prefill_size: int,
    shard_size: int,
    geometry: DsaScratchGeometry = DsaScratchGeometry(),
    with_mtp: bool = False,
) -> DsaScratchFigure:
    """The scratch upstream charges one sharded DSA prefill rank, from its spec class."""
    from sglang.srt.mem_cache.page_interleave import (
        _KV_SHARD_SCRATCH_PREFIX_CONTEXTS,
        PageShardSpec,
    )

    span = shard_size * DSA_PAGE_SIZE
    chunk_tokens = -(-chunked_prefill_size // DSA_PAGE_SIZE) * DSA_PAGE_SIZE
    spec = PageShardSpec(
        shard_rank=0,
        shard_size=shard_size,
        page_size=DSA_PAGE_SIZE,
        max_prefix_tokens=_KV_SHARD_SCRATCH_PREFIX_CONTEXTS * (-(-context_len // span) * span),
        chunk_tokens=chunk_tokens,
    )
    return DsaScratchFigure(
        kv_cache_dtype=kv_cache_dtype,
        context_len=context_len,
        chunk_tokens=chunk_tokens,
        shard_size=shard_size,
        rows_per_slot=spec.scratch_rows,
        row_bytes=geometry.row_bytes(kv_cache_dtype),
        with_mtp=with_mtp,
    )


def scratch_figure_of_pool(pool: Any, *, context_len: int, with_mtp: bool) -> DsaScratchFigure:
    """The charge of a live sharded DSA pool, from the spec upstream built it with."""
    spec = pool.shard_spec
    kv_cache_dtype = "fp8_e4m3" if pool.dsa_kv_cache_store_fp8 else "bfloat16"
    geometry = DsaScratchGeometry(pool.kv_lora_rank, pool.qk_rope_head_dim, pool.index_head_dim)
    return DsaScratchFigure(
        kv_cache_dtype=kv_cache_dtype,
        context_len=context_len,
        chunk_tokens=spec.chunk_tokens,
        shard_size=spec.shard_size,
        rows_per_slot=spec.scratch_rows,
        row_bytes=geometry.row_bytes(kv_cache_dtype),
        with_mtp=with_mtp,
    )


def log_startup_scratch(runner: Any, pool: Any) -> DsaScratchFigure:
    """Log the scratch this target rank was charged (called once per rank, at startup,
    under the flag). MTP is budgeted as upstream does: a target with an EAGLE draft
    (``pool_configurator.py:252-257``, ``include_mtp``)."""
    figure = scratch_figure_of_pool(
        pool,
        context_len=runner.model_config.context_len,
        with_mtp=runner.spec_algorithm.is_eagle(),
    )
    logger.info("CP rank %d/%d: %s", pool.shard_rank, pool.shard_size, figure.line())
    return figure
