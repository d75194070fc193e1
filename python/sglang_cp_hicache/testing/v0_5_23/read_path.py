"""Upstream SGLang 0.5.23's sharded DSA read path on CPU ranks, beside its replicated twin.

One prefill extend with a cached prefix runs, on each prefill-CP rank, through the REAL
upstream objects wherever they run on CPU (paths under ``sglang/srt/``):

* ``PageInterleaveDSATokenToKVPool`` (one rank's stripe, gloo shard group): the owner filter
  of every write (``_get_write_plan``, ``write_targets``), ``begin_shard_extend``'s gather
  plan (reached through ``kv_shard_hooks.prepare_kv_shard_forward``), the per-layer prefix
  all-gather one layer ahead (``_prefetch_layer`` / ``_acquire_slot_for_read``),
  ``translate_loc_to_scratch``, the chunk staged into the scratch, ``get_key_buffer`` and
  ``get_index_k_scale_buffer`` (``_PageInterleaveIndexKeyCache`` maps logical pages through
  ``_page_pos``);
* ``DeepseekSparseAttnBackend`` itself, built as an H200 (SM 9.0) prefill backend in one of
  the two :class:`DsaKvFormat` s an H200 resolves (``flashmla_sparse`` over bf16 rows, or
  ``flashmla_kv`` over the packed fp8 rows) with the torch top-k backend: ``init_forward_metadata``
  (``layers/attention/dsa_backend.py:1095``; the plan :1121, ``page_table_1`` translated
  into scratch rows and the logical page table kept for the indexer :1284-1290),
  ``get_indexer_metadata`` and its ``topk_transform`` (upstream's torch top-k), and
  ``forward_extend`` (:2164: the pool write, ``get_key_buffer``, the PAGED top-k to
  page-table transform, ``_forward_flashmla_sparse`` or ``_forward_flashmla_kv``);
* prefill CP interleave: ``layers/cp/utils.prepare_cp_forward`` and
  ``InterleaveCPStrategy`` (query sharding, the latent-KV and indexer-key gathers, the
  hidden-state gather).

:class:`CpuKernelStandIns` replaces only what needs a GPU: the Triton/CUDA kernels (for fp8,
the store's quantizer and FlashMLA's sparse decode kernel and schedule,
:mod:`~sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference`), the NCCL collective behind
the CP gathers, and the device capability the backend reads once.
The indexer's own compute (projections, the fp8 MQA logits kernel) is
:class:`StandInIndexer`: upstream's ``Indexer.forward_cuda`` asserts a CUDA device; the
stand-in reads index K exactly where ``Indexer._get_topk_ragged`` does (the pool getter
with the metadata's logical page table) and selects with the metadata's real top-k.

The reference is the same computation on an unsharded ``DSATokenToKVPool`` holding every
page at its logical loc (upstream without ``--enable-kv-cache-sharding``): same rank, same
CP split, same logical locs, inputs and stand-in kernels, so every record compares bit for
bit. Prefixes are page-aligned: a sharded extend refuses any other
(``mem_cache/page_interleave_pool.py:378-383``, in ``begin_shard_extend``). A chunked prefill
(:meth:`ReadPathRank.compare_chunked_to_replicated`) runs two extends on the same pools, the
second reading as prefix what the first wrote.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import math
import sys
import tempfile
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any, Iterator, List, Optional, Tuple

import torch

from sglang_cp_hicache.core.rotation import lane_of, owner_of
from sglang_cp_hicache.testing.reference_sparse_mla import (
    LayerWeights,
    SparseMLAConfig,
    dequantize_index_k,
    flash_mla_sparse_fwd_reference,
    interleave_split,
    quantize_index_k,
    random_weights,
)
from sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference import (
    NOPE_TILE,
    flash_mla_with_kvcache_reference,
    get_mla_metadata_reference,
    packed_row_bytes,
    quantize_k_cache_separate_reference,
)
from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooGatherCommunicator, GlooShardGroup

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


# --------------------------------------------------------------- GPU-kernel stand-ins
def get_k_and_s_reference(
    cls,
    pool: Any,
    buf: torch.Tensor,
    page_indices: torch.Tensor,
    seq_len_tensor: torch.Tensor,
    seq_len_sum: int,
    max_seq_len: int,
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``GetKAndS.triton`` (``kernels/ops/kvcache/dsa_index_k_cache.py``): row ``b``'s
    first ``seq_len[b]`` tokens from pages ``page_indices[b]``, keys then fp32 scales, all
    rows concatenated (uint8 ``[seq_len_sum, 128]`` and ``[seq_len_sum, 4]``)."""
    ps, head_dim = pool.index_page_size, pool.index_head_dim
    keys, scales = [], []
    for row, seq_len in enumerate(seq_len_tensor.tolist()):
        pages = buf[page_indices[row, : -(-seq_len // ps)].long()]
        keys.append(pages[:, : ps * head_dim].reshape(-1, head_dim)[:seq_len])
        scales.append(pages[:, ps * head_dim :].reshape(-1, 4)[:seq_len])
    k_out, s_out = torch.cat(keys), torch.cat(scales)
    if k_out.shape[0] != seq_len_sum:
        raise ValueError(f"GetKAndS (CPU stand-in): {k_out.shape[0]} rows, not {seq_len_sum}")
    return k_out, s_out


def transform_index_page_table_prefill_reference(
    page_table: torch.Tensor,
    topk_indices: torch.Tensor,
    extend_lens_cpu: List[int],
    page_size: int = 1,
    output_num_tokens: Optional[int] = None,
    page_table_is_expanded: bool = False,
    cu_seqlens_q: Optional[torch.Tensor] = None,
) -> torch.Tensor:
    """Torch ``transform_index_page_table_prefill`` (``kernels/ops/attention/dsa/
    transform_index.py``): query ``q`` of request row ``i`` maps each selected position
    ``p >= 0`` to ``page_table[i, p]``; -1 stays -1, and so do padded query rows."""
    if page_size != 1 or page_table_is_expanded:
        raise NotImplementedError("transform stand-in: page_size 1, unexpanded table only")
    rows = output_num_tokens if output_num_tokens is not None else topk_indices.shape[0]
    result = torch.full((rows, topk_indices.shape[1]), -1, dtype=torch.int32)
    starts = (
        cu_seqlens_q.tolist()
        if cu_seqlens_q is not None
        else [0, *torch.tensor(extend_lens_cpu).cumsum(0).tolist()]
    )
    for i in range(len(starts) - 1):
        selected = topk_indices[starts[i] : starts[i + 1]].long()
        mapped = page_table[i][selected.clamp(min=0)].to(torch.int32)
        result[starts[i] : starts[i + 1]] = torch.where(selected >= 0, mapped, -1)
    return result


def dsa_cp_interleave_q_seqs_reference(
    extend_seqs: torch.Tensor, num_rank_seqs: int, cp_size: int, cp_rank: int
) -> Tuple[torch.Tensor, torch.Tensor]:
    """Torch ``dsa_cp_interleave_q_seqs`` (``kernels/ops/attention/dsa/cp_split.py``): this
    rank's share of each request's extend (tokens interleaved over the whole batch, the
    remainder carried to the next request) and the requests it has any of."""
    lens, batch_rows = interleave_split(extend_seqs.tolist(), cp_size, cp_rank)
    if len(lens) != num_rank_seqs:
        raise ValueError(f"cp split stand-in: {len(lens)} requests, expected {num_rank_seqs}")
    return (
        torch.tensor(lens, dtype=extend_seqs.dtype),
        torch.tensor(batch_rows, dtype=torch.int32),
    )


class CpuKernelStandIns:
    """Installs (``with``) the torch stand-ins of what needs a GPU, and removes them.

    * ``GetKAndS.triton``, ``transform_index_page_table_prefill`` (as ``dsa_backend``
      binds it), ``dsa_cp_interleave_q_seqs``: Triton kernels (no driver on CPU);
    * ``flash_mla_interface.flash_mla_sparse_fwd`` (bf16) and, for the packed fp8 format,
      ``flash_mla_with_kvcache`` and ``get_mla_metadata``: the module imports the CUDA-only
      ``flash_mla`` package, so where that fails a stand-in module takes its place;
    * ``memory_pool.quantize_k_cache_separate``: the packed fp8 store's quantizer (Triton);
    * ``layers/cp/interleave.attn_cp_all_gather_into_tensor``: the attention-CP
      ``GroupCoordinator``'s NCCL all-gather, here over the gloo CP group;
    * ``torch.cuda.get_device_capability`` (while a backend is built): an H200.

    The runtime already provides the rest (the indexer store ``SetKAndS``, the pool's
    gather communicator; :mod:`~sglang_cp_hicache.testing.v0_5_23.runtime`).
    """

    FLASH_MLA_INTERFACE = "sglang.kernels.ops.attention.flash_mla_interface"

    def __init__(self, cp_group: Any):
        self._cp_gather = GlooGatherCommunicator(group=cp_group, device="cpu")
        self._stack = contextlib.ExitStack()

    def _set(self, target: Any, name: str, value: Any) -> None:
        original = getattr(target, name)
        setattr(target, name, value)
        self._stack.callback(setattr, target, name, original)

    FLASH_MLA_STAND_INS = {
        "flash_mla_sparse_fwd": flash_mla_sparse_fwd_reference,
        "flash_mla_with_kvcache": flash_mla_with_kvcache_reference,
        "get_mla_metadata": get_mla_metadata_reference,
    }

    def _install_flash_mla(self) -> None:
        try:
            module = importlib.import_module(self.FLASH_MLA_INTERFACE)
        except ImportError:  # no flash_mla wheel: a module holding only the stand-ins
            module = ModuleType(self.FLASH_MLA_INTERFACE)
            for name, stand_in in self.FLASH_MLA_STAND_INS.items():
                setattr(module, name, stand_in)
            sys.modules[self.FLASH_MLA_INTERFACE] = module
            self._stack.callback(sys.modules.pop, self.FLASH_MLA_INTERFACE, None)
            return
        for name, stand_in in self.FLASH_MLA_STAND_INS.items():
            self._set(module, name, stand_in)

    def __enter__(self) -> "CpuKernelStandIns":
        from sglang.kernels.ops.attention.dsa import cp_split
        from sglang.kernels.ops.kvcache import dsa_index_k_cache
        from sglang.srt.layers.attention import dsa_backend
        from sglang.srt.layers.cp import interleave
        from sglang.srt.mem_cache import memory_pool

        self._set(dsa_index_k_cache.GetKAndS, "triton", classmethod(get_k_and_s_reference))
        self._set(memory_pool, "quantize_k_cache_separate", quantize_k_cache_separate_reference)
        self._set(
            dsa_backend,
            "transform_index_page_table_prefill",
            transform_index_page_table_prefill_reference,
        )
        self._set(cp_split, "dsa_cp_interleave_q_seqs", dsa_cp_interleave_q_seqs_reference)
        self._set(interleave, "attn_cp_all_gather_into_tensor", self._cp_gather.all_gather)
        self._install_flash_mla()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @staticmethod
    @contextlib.contextmanager
    def hopper_capability() -> Iterator[None]:
        original = torch.cuda.get_device_capability
        torch.cuda.get_device_capability = lambda *args, **kwargs: HOPPER_CAPABILITY
        try:
            yield
        finally:
            torch.cuda.get_device_capability = original


# ------------------------------------------------------------------- runtime context
def _dsa_model_config(config: SparseMLAConfig, context_len: int) -> Any:
    """A real ``ModelConfig`` of a tiny GLM-5 (``GlmMoeDsaForCausalLM``) geometry."""
    from sglang.srt.configs.model_config import ModelConfig
    from transformers import GlmMoeDsaConfig

    hf_config = GlmMoeDsaConfig(
        vocab_size=128,
        hidden_size=config.hidden_size,
        intermediate_size=config.hidden_size,
        moe_intermediate_size=config.hidden_size // 2,
        num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_heads,
        num_key_value_heads=config.num_heads,
        n_routed_experts=4,
        num_experts_per_tok=2,
        kv_lora_rank=config.kv_lora_rank,
        q_lora_rank=config.hidden_size,
        qk_rope_head_dim=config.qk_rope_head_dim,
        qk_nope_head_dim=config.kv_lora_rank,
        v_head_dim=config.kv_lora_rank,
        index_topk=config.index_topk,
        index_head_dim=config.index_head_dim,
        index_n_heads=config.index_n_heads,
        max_position_embeddings=context_len,
        first_k_dense_replace=config.num_layers,
    )
    hf_config.architectures = ["GlmMoeDsaForCausalLM"]
    with tempfile.TemporaryDirectory(prefix="read-path-model-") as path:
        hf_config.save_pretrained(path)
        return ModelConfig(model_path=path, context_length=context_len)


def publish_runtime_context(
    config: SparseMLAConfig,
    spec: ReadPathBatchSpec,
    shard_group: GlooShardGroup,
    kv_format: DsaKvFormat = FLASHMLA_SPARSE_BF16,
) -> Any:
    """Publish this rank's config the way the backend and CP strategy read it: a DSA model,
    ``kv_format``'s prefill and decode backends, torch top-k (target and MTP draft), prefill
    CP interleave over the shard group (``attn_cp_size`` = ``tp_size`` = shard size, as
    ``kv_shard_hook`` requires)."""
    from sglang.srt.runtime_context import get_context, get_parallel, get_server_args
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    set_global_server_args_for_scheduler(
        ServerArgs(
            model_path="dummy",
            page_size=config.page_size,
            context_length=spec.context_len,
            chunked_prefill_size=spec.chunked_prefill_size,
        )
    )
    # A ModelConfig supplied on the record is used as is (model_override_base.py:200-211).
    get_server_args()._model_config = model_config = _dsa_model_config(config, spec.context_len)
    get_context().override(
        "read_path",
        dsa_prefill_backend=kv_format.prefill_backend,
        dsa_decode_backend=kv_format.decode_backend,
        dsa_topk_backend="torch",
        speculative_dsa_topk_backend="torch",  # what the MTP draft's backend reads
    )
    size = shard_group.world_size
    get_parallel().override_permanently(
        tp_size=size,
        moe_tp_size=size,
        attn_cp_size=size,
        attn_cp_rank=shard_group.rank_in_group,
        attn_cp_group=shard_group,
        enable_prefill_cp=True,
        cp_strategy="interleave",
    )
    return model_config


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


def _forward_batch(batch: ReadPathBatch) -> Any:
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
        return _forward_batch(batch)

    def _finished(self, record: ForwardRecord) -> ForwardRecord:
        """The record as the comparison reads it."""
        return record


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
        b, r = self.batch, self.config.kv_lora_rank
        for layer_id, layer in enumerate(self.layers):
            kv = b.prefix_kv[layer_id][:, None, :]
            pool.set_mla_kv_buffer(layer, b.prefix_locs, kv[..., :r], kv[..., r:])
            index_k, scale = quantize_index_k(b.prefix_index_key[layer_id])
            pool.set_index_k_scale_buffer(layer_id, b.prefix_locs, index_k, scale)

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


__all__ = [
    "CpuKernelStandIns",
    "DsaKvFormat",
    "FLASHMLA_KV_FP8",
    "FLASHMLA_SPARSE_BF16",
    "FP8_READ_PATH_CONFIG",
    "KV_FORMATS",
    "ForwardRecord",
    "IndexRead",
    "LayerMatch",
    "READ_PATH_CONFIG",
    "ReadCoverage",
    "ReadPathBatch",
    "ReadPathBatchSpec",
    "ReadPathComparison",
    "ReadPathModel",
    "ReadPathPools",
    "ReadPathRank",
    "StandInIndexer",
    "block_table_problems",
    "build_backend",
    "build_batch",
    "compare",
    "owned_rows_problems",
    "publish_runtime_context",
    "read_coverage",
    "read_path_session",
    "split_batch",
]
