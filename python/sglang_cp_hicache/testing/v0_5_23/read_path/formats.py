"""The DSA KV formats an H200 resolves (bf16 flashmla_sparse, packed fp8 flashmla_kv)
and the read path's model geometry."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from sglang_cp_hicache.testing.reference_sparse_mla import SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference import NOPE_TILE, packed_row_bytes


#: DSA's only physical page size (``memory_pool.py:5371``) and indexer key width (:5346).
DSA_PAGE_SIZE = 64
DSA_INDEX_HEAD_DIM = 128
#: An H200: the capability the backend reads at construction (flashmla head padding 64).
HOPPER_CAPABILITY = (9, 0)

READ_PATH_CONFIG = SparseMLAConfig(
    num_layers=3,  # >= 3: a stale scratch slot then holds an earlier layer's prefix
    hidden_size=64,
    num_heads=4,
    kv_lora_rank=32,
    qk_rope_head_dim=16,
    index_n_heads=2,
    index_head_dim=DSA_INDEX_HEAD_DIM,
    index_topk=48,  # below most positions: the indexer's choice matters
    page_size=DSA_PAGE_SIZE,
    kv_dtype=torch.bfloat16,
)
#: The geometry FlashMLA's packed fp8 format (``V32``) and its quantizer accept: NoPE a
#: multiple of 128, RoPE 64 (GLM-5 / DeepSeek-V3.2's 512 + 64: 656-byte rows).
FP8_READ_PATH_CONFIG = dataclasses.replace(READ_PATH_CONFIG, kv_lora_rank=512, qk_rope_head_dim=64)


@dataclass(frozen=True)
class DsaKvFormat:
    """A KV format an H200 resolves for DSA, and the kernels that read it
    (``arg_groups/overrides.py:714-726``). ``config.kv_dtype`` is the compute dtype (q, the
    latent the model writes); ``pool_dtype`` is what the pool stores."""

    name: str
    prefill_backend: str
    decode_backend: str
    pool_dtype: torch.dtype
    config: SparseMLAConfig

    def __post_init__(self) -> None:
        c = self.config
        if self.packed_fp8 and (c.kv_lora_rank % NOPE_TILE or c.qk_rope_head_dim != 64):
            raise ValueError(f"{self.name}: the packed fp8 rows need NoPE % 128 == 0 and RoPE 64")

    @property
    def packed_fp8(self) -> bool:
        return self.pool_dtype == torch.float8_e4m3fn

    @property
    def pool_kv_cache_dim(self) -> int:
        """The pool's ``kv_cache_dim``: values per row (bf16), bytes per row (packed fp8)."""
        c = self.config
        if self.packed_fp8:
            return packed_row_bytes(c.kv_lora_rank, c.qk_rope_head_dim)
        return c.kv_cache_dim


#: bf16 rows read by token index (``flash_mla_sparse_fwd`` over ``page_table_1``).
FLASHMLA_SPARSE_BF16 = DsaKvFormat(
    "flashmla_sparse/bfloat16", "flashmla_sparse", "flashmla_sparse", torch.bfloat16,
    READ_PATH_CONFIG,
)  # fmt: skip
#: packed fp8 rows read through 64-token blocks (``flash_mla_with_kvcache``, sparse V32).
FLASHMLA_KV_FP8 = DsaKvFormat(
    "flashmla_kv/fp8_e4m3", "flashmla_kv", "flashmla_kv", torch.float8_e4m3fn,
    FP8_READ_PATH_CONFIG,
)  # fmt: skip
KV_FORMATS = (FLASHMLA_SPARSE_BF16, FLASHMLA_KV_FP8)
