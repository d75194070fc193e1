"""Startup self-test of the shared-KV read path on this rank's device and CP group.

Run once per rank at init, before serving (``run_startup_selftest``). It builds a small
synthetic multi-request batch, identical on every rank (seeded), with the shapes that
matter: a partial last prefix page, a request sharing another's prefix pages (radix hit),
a chunk of more than 768 locs (FlashMLA's TMA store path), and the highest logical page
the pool can address. Then, for the server's KV geometry and dtype:

* *replicated*: one pool holding every page at its logical loc (what upstream reads);
* *shared*: this rank's physical pool written through the plugin's write translation,
  the prefix materialised over the real CP group with the configured strategy, the chunk
  stored into the dense buffer at dense locs (what the hooks do per layer).

Each stage compares the two, bit for bit, and the first mismatch raises
:class:`SharedKVSelfTestFailed` naming it. Readers run through a :class:`ReaderKernels`
set: SGLang's real kernels on CUDA (:class:`SGLangCudaKernels`), the torch reference of
the same stages on CPU (``sglang_cp_hicache.testing.v0_5_12.selftest_kernels``, registered by the
CPU runtime). A second check,
:func:`materialization_round_trip`, moves a deterministic per-page pattern over the group.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Protocol, Sequence, Tuple

import numpy as np
import torch

from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import (
    CpSharedKVBatchMapping,
    build_batch_mapping,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import (
    DenseLayerKV,
    PagedLayerGeometry,
    PoolPageReader,
    make_strategy,
)
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_write import translate_out_cache_loc
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

logger = logging.getLogger(__name__)

SELFTEST_BUDGET_S = 2.0
INDEX_HEAD_DIM = 128
INDEX_SCALE_BYTES = 4
FP8_KV_ROW_BYTES = 656  # 512 fp8 nope + 4 fp32 tile scales + 64 bf16 rope
KV_LORA_RANK = 512
FP8_NOPE_TILES = 4


class SharedKVSelfTestFailed(RuntimeError):
    """The startup self-test found shared KV differing from replicated KV at a stage."""

    def __init__(self, stage: str, detail: str):
        super().__init__(
            f"--enable-nsa-prefill-cp-shared-kv startup self-test failed at stage "
            f"'{stage}': {detail}. Refusing to serve."
        )
        self.stage = stage


# ----------------------------------------------------------------------- batch
@dataclass(frozen=True)
class SelfTestBatchSpec:
    """Request shapes (tokens). Request 1 reuses request 0's first ``shared_prefix_pages``
    pages; prefix 150 ends mid-page; the chunk totals 857 locs (> 768)."""

    prefix_lens: Tuple[int, ...] = (150, 165, 70)
    extend_lens: Tuple[int, ...] = (800, 40, 17)
    shared_prefix_pages: int = 2
    num_layers: int = 2
    seed: int = 1234


@dataclass(frozen=True)
class SelfTestBatch:
    """Identical on every rank: logical locs of each request, page ids, lengths."""

    page_size: int
    physical_pages: int  # per rank, padding page excluded
    request_pages: Tuple[np.ndarray, ...]
    prefix_lens: Tuple[int, ...]
    seq_lens: Tuple[int, ...]

    def request_locs(self, i: int) -> np.ndarray:
        positions = np.arange(self.seq_lens[i])
        return self.request_pages[i][positions // self.page_size] * self.page_size + positions % self.page_size

    def prefix_locs(self) -> np.ndarray:
        return np.unique(np.concatenate([self.request_locs(i)[:p] for i, p in enumerate(self.prefix_lens)]))

    def chunk_locs(self) -> np.ndarray:
        """The chunk's locs in batch order (``out_cache_loc``)."""
        return np.concatenate([self.request_locs(i)[p:] for i, p in enumerate(self.prefix_lens)])

    def max_logical_loc(self) -> int:
        return int(max(self.request_locs(i).max() for i in range(len(self.seq_lens))))


def build_selftest_batch(spec: SelfTestBatchSpec, cp_size: int, page_size: int) -> SelfTestBatch:
    seq_lens = tuple(p + e for p, e in zip(spec.prefix_lens, spec.extend_lens, strict=True))
    pages_needed = [-(-n // page_size) for n in seq_lens]
    distinct = sum(pages_needed) - spec.shared_prefix_pages
    physical_pages = -(-distinct // cp_size) + 1
    num_logical_pages = cp_size * (physical_pages + 1)
    rng = np.random.default_rng(spec.seed)
    # Logical pages 0 .. cp_size-1 map to physical page 0 (padding): never allocated.
    free = list(rng.permutation(np.arange(cp_size, num_logical_pages - 1)))
    free.append(num_logical_pages - 1)  # the highest addressable page is used first
    request_pages: List[np.ndarray] = []
    for i, n in enumerate(pages_needed):
        reused = list(request_pages[0][: spec.shared_prefix_pages]) if i == 1 else []
        request_pages.append(np.array(reused + [free.pop() for _ in range(n - len(reused))], dtype=np.int64))
    return SelfTestBatch(page_size, physical_pages, tuple(request_pages), tuple(spec.prefix_lens), seq_lens)


# ----------------------------------------------------------------------- pools
@dataclass
class SelfTestPool:
    """An NSA pool's layer buffers and the attributes SGLang's readers use.

    ``kv_buffer[l]``: ``[num_tokens, *kv_token_shape]`` in the store dtype;
    ``index_k_with_scale_buffer[l]``: ``[num_pages, page_size * 132]`` uint8.
    """

    geometry: PagedLayerGeometry
    num_pages: int
    num_layers: int
    device: torch.device
    start_layer: int = 0
    index_head_dim: int = INDEX_HEAD_DIM
    quant_block_size: int = INDEX_HEAD_DIM
    kv_buffer: List[torch.Tensor] = field(init=False)
    index_k_with_scale_buffer: List[torch.Tensor] = field(init=False)

    def __post_init__(self) -> None:
        g = self.geometry
        tokens = self.num_pages * g.page_size
        self.kv_buffer = [
            torch.zeros(tokens, *g.kv_token_shape, dtype=g.kv_store_dtype, device=self.device)
            for _ in range(self.num_layers)
        ]
        self.index_k_with_scale_buffer = [
            torch.zeros(self.num_pages, g.index_page_bytes, dtype=torch.uint8, device=self.device)
            for _ in range(self.num_layers)
        ]

    @property
    def page_size(self) -> int:
        return self.geometry.page_size

    @property
    def size(self) -> int:
        """Usable tokens, padding page excluded (as ``NSATokenToKVPool.size``)."""
        return (self.num_pages - 1) * self.page_size

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.kv_buffer[layer_id - self.start_layer]

    def get_index_k_with_scale_buffer(self, layer_id: int) -> torch.Tensor:
        return self.index_k_with_scale_buffer[layer_id - self.start_layer]


@dataclass(frozen=True)
class TokenRows:
    """KV and index-K bytes of tokens: ``kv`` rows in the store dtype, ``index_k``
    ``[n, 128]`` uint8 (fp8 bits), ``index_s`` ``[n, 4]`` uint8 (fp32 bits)."""

    kv: torch.Tensor
    index_k: torch.Tensor
    index_s: torch.Tensor

    def take(self, rows: torch.Tensor) -> "TokenRows":
        return TokenRows(self.kv[rows], self.index_k[rows], self.index_s[rows])


def random_token_rows(geometry: PagedLayerGeometry, num: int, gen: torch.Generator, device) -> TokenRows:
    """Finite values for every field (NaN would break bitwise comparison of outputs)."""
    if geometry.kv_token_shape[-1] == FP8_KV_ROW_BYTES:
        nope = torch.randn(num, KV_LORA_RANK, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
        scales = (torch.rand(num, FP8_NOPE_TILES, generator=gen) + 0.5).view(torch.uint8)
        rope = torch.randn(num, 64, generator=gen).to(torch.bfloat16).view(torch.uint8)
        kv = torch.cat([nope, scales, rope], dim=1).view(geometry.kv_store_dtype)
    else:
        kv = torch.randn(num, geometry.kv_token_shape[-1], generator=gen).to(geometry.kv_store_dtype)
    kv = kv.view(num, *geometry.kv_token_shape)
    index_k = torch.randn(num, INDEX_HEAD_DIM, generator=gen).to(torch.float8_e4m3fn).view(torch.uint8)
    index_s = (torch.rand(num, 1, generator=gen) + 0.5).view(torch.uint8)
    return TokenRows(kv.to(device), index_k.to(device), index_s.to(device))


def write_tokens(kv: torch.Tensor, index: torch.Tensor, page_size: int, locs: torch.Tensor, rows: TokenRows) -> None:
    """Store token rows at ``locs`` in SGLang's NSA layout (index K page-major: all K
    bytes of the page, then all scale bytes)."""
    kv[locs] = rows.kv
    pages, offsets = locs // page_size, locs % page_size
    k_part = index[:, : page_size * INDEX_HEAD_DIM].unflatten(1, (page_size, INDEX_HEAD_DIM))
    s_part = index[:, page_size * INDEX_HEAD_DIM :].unflatten(1, (page_size, INDEX_SCALE_BYTES))
    k_part[pages, offsets] = rows.index_k
    s_part[pages, offsets] = rows.index_s


# ----------------------------------------------------------------------- readers
@dataclass(frozen=True)
class ReadSide:
    """What SGLang's readers see on one side: buffers and page tables addressing them."""

    pool: SelfTestPool
    kv_buffer: torch.Tensor
    index_buffer: torch.Tensor
    page_table_1: torch.Tensor  # [bs, max_seq_len] int32 locs
    real_page_table: torch.Tensor  # [bs, max_pages] int32 pages
    seq_lens: torch.Tensor  # [bs] int32
    extend_lens: Tuple[int, ...]


class ReaderKernels(Protocol):
    """The NSA read stages; each returns tensors compared bitwise across sides."""

    name: str

    def get_k_and_s(self, side: ReadSide) -> Tuple[torch.Tensor, ...]: ...

    def get_k_get_s(self, side: ReadSide) -> Tuple[torch.Tensor, ...]: ...

    def topk_transform(self, side: ReadSide, scores: torch.Tensor, lengths: torch.Tensor, topk: int) -> torch.Tensor: ...

    def sparse_attention(self, side: ReadSide, q: torch.Tensor, indices: torch.Tensor) -> torch.Tensor: ...

    def sparse_attention_kv(self, side: ReadSide, q: torch.Tensor, indices: torch.Tensor, lengths: torch.Tensor) -> Optional[torch.Tensor]:
        """FlashMLA kv (fp8 KV only; ``None`` otherwise)."""

    def dequantize_paged(self, side: ReadSide, flat_locs: torch.Tensor) -> Optional[torch.Tensor]: ...


def _query_rows(side: ReadSide) -> torch.Tensor:
    """Request row of each chunk token (batch order)."""
    return torch.repeat_interleave(
        torch.arange(len(side.extend_lens), device=side.page_table_1.device),
        torch.tensor(side.extend_lens, device=side.page_table_1.device),
    )


class SGLangCudaKernels:
    """SGLang 0.5.12.post1's real NSA readers and sgl-kernel kernels (CUDA only)."""

    name = "sglang-cuda"
    topk = 2048

    def get_k_and_s(self, side):
        from sglang.srt.layers.attention.nsa.index_buf_accessor import GetKAndS

        lens = side.seq_lens
        return GetKAndS.execute(
            side.pool, side.index_buffer, page_indices=side.real_page_table, seq_len_tensor=lens,
            seq_len_sum=int(lens.sum()), max_seq_len=int(lens.max()),
        )

    def get_k_get_s(self, side):
        from sglang.srt.layers.attention.nsa.index_buf_accessor import GetK, GetS

        out = []
        for i, n in enumerate(side.seq_lens.tolist()):
            pages = side.real_page_table[i]
            out.append(GetK.execute(side.pool, side.index_buffer, seq_len=n, page_indices=pages))
            out.append(GetS.execute(side.pool, side.index_buffer, seq_len=n, page_indices=pages))
        return tuple(out)

    def topk_transform(self, side, scores, lengths, topk):
        from sgl_kernel import fast_topk_transform_fused

        device = scores.device
        cu_seqlens_q = torch.zeros(len(side.extend_lens) + 1, dtype=torch.int32, device=device)
        cu_seqlens_q[1:] = torch.tensor(np.cumsum(side.extend_lens), dtype=torch.int32, device=device)
        return fast_topk_transform_fused(
            score=scores, lengths=lengths, page_table_size_1=side.page_table_1,
            cu_seqlens_q=cu_seqlens_q, topk=topk, row_starts=None,
        )

    def sparse_attention(self, side, q, indices):
        from sgl_kernel.flash_mla import flash_mla_sparse_fwd

        kv = side.kv_buffer
        if kv.shape[-1] == FP8_KV_ROW_BYTES:  # fp8 store: SGLang dequantises, then sparse
            from sglang.srt.layers.attention.nsa.dequant_k_cache import dequantize_k_cache_paged

            flat = torch.arange(kv.shape[0], dtype=torch.int32, device=kv.device)
            kv = dequantize_k_cache_paged(kv.view(torch.float8_e4m3fn), flat)
        out, _, _ = flash_mla_sparse_fwd(
            q=q, kv=kv.view(-1, 1, kv.shape[-1]), indices=indices.unsqueeze(1),
            sm_scale=q.shape[-1] ** -0.5, d_v=KV_LORA_RANK,
        )
        return out

    def sparse_attention_kv(self, side, q, indices, lengths):
        if side.kv_buffer.shape[-1] != FP8_KV_ROW_BYTES:
            return None
        from sgl_kernel.flash_mla import flash_mla_with_kvcache, get_mla_metadata

        heads = q.shape[1]
        cache_seqlens = lengths.clamp(max=self.topk).to(torch.int32)
        metadata, num_splits = get_mla_metadata(
            cache_seqlens=cache_seqlens, num_q_tokens_per_head_k=heads, num_heads_k=1,
            num_heads_q=heads, is_fp8_kvcache=True, topk=self.topk,
        )
        out, _ = flash_mla_with_kvcache(
            q=q.view(-1, 1, heads, q.shape[-1]),
            k_cache=side.kv_buffer.view(-1, side.pool.page_size, 1, FP8_KV_ROW_BYTES),
            cache_seqlens=cache_seqlens, head_dim_v=KV_LORA_RANK,
            tile_scheduler_metadata=metadata, num_splits=num_splits,
            softmax_scale=q.shape[-1] ** -0.5, indices=indices.unsqueeze(1),
            block_table=torch.empty((q.shape[0], 0), dtype=torch.int32, device=q.device),
            is_fp8_kvcache=True,
        )
        return out

    def dequantize_paged(self, side, flat_locs):
        if side.kv_buffer.shape[-1] != FP8_KV_ROW_BYTES:
            return None
        from sglang.srt.layers.attention.nsa.dequant_k_cache import dequantize_k_cache_paged

        return dequantize_k_cache_paged(side.kv_buffer.view(torch.float8_e4m3fn), flat_locs)


# Reader kernels per device type. The CPU runtime registers its torch reference for "cpu"
# (``sglang_cp_hicache.testing.v0_5_12.selftest_kernels``): product code never imports testing code.
READER_KERNELS: Dict[str, Callable[[], ReaderKernels]] = {"cuda": SGLangCudaKernels}


def default_reader_kernels(device: torch.device) -> ReaderKernels:
    factory = READER_KERNELS.get(device.type)
    if factory is None:
        raise SharedKVSelfTestFailed(
            "reader_kernels",
            f"no NSA reader kernels for device {device.type!r} (CUDA, or the CPU runtime's "
            "torch reference)",
        )
    return factory()


# ----------------------------------------------------------------------- the test
def logical_capacity_tokens(physical_size: int, layout: CpSharedKVLayout) -> int:
    """``size`` of the logical view of a physical pool of ``physical_size`` usable tokens.

    SGLang bounds locs by ``size + page_size``; logical locs reach
    ``cp * (size + page) - 1`` (every lane has a padding page), so the view reports
    ``cp * (size + page) - page``.
    """
    return layout.cp_size * (physical_size + layout.page_size) - layout.page_size


@dataclass
class SelfTestReport:
    stages: List[str] = field(default_factory=list)
    seconds: float = 0.0


class _Stage:
    """Records the stage name; a mismatch raises naming it."""

    def __init__(self, report: SelfTestReport):
        self.report = report

    def check(self, stage: str, ok: bool, detail: str) -> None:
        if not ok:
            raise SharedKVSelfTestFailed(stage, detail)
        self.report.stages.append(stage)

    def equal(self, stage: str, shared: Sequence[torch.Tensor], replicated: Sequence[torch.Tensor]) -> None:
        for i, (a, b) in enumerate(zip(shared, replicated, strict=True)):
            same = a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
            if not same:
                self.check(stage, False, f"output {i} differs between shared and replicated KV")
        self.report.stages.append(stage)


def _page_tables(batch: SelfTestBatch, device, remap: Optional[CpSharedKVBatchMapping]) -> Tuple[torch.Tensor, torch.Tensor]:
    bs, ps = len(batch.seq_lens), batch.page_size
    width = max(batch.seq_lens)
    page_table_1 = torch.zeros(bs, width, dtype=torch.int32)
    real = torch.zeros(bs, -(-width // ps), dtype=torch.int32)
    for i in range(bs):
        locs = torch.as_tensor(batch.request_locs(i))
        page_table_1[i, : len(locs)] = locs.int()
        real[i, : len(batch.request_pages[i])] = torch.as_tensor(batch.request_pages[i]).int()
    page_table_1, real = page_table_1.to(device), real.to(device)
    if remap is not None:
        page_table_1, real = remap.remap_logical_locs(page_table_1), remap.remap_logical_pages(real)
    return page_table_1, real


def run_kernel_equivalence(
    geometry: PagedLayerGeometry,
    layout: CpSharedKVLayout,
    group: Any,
    strategy: str,
    kernels: ReaderKernels,
    device: torch.device,
    spec: SelfTestBatchSpec = SelfTestBatchSpec(),
    report: Optional[SelfTestReport] = None,
) -> SelfTestReport:
    """Stage (a): replicated pool vs this rank's shared path, bitwise, per stage."""
    report = report or SelfTestReport()
    stage = _Stage(report)
    ps = layout.page_size
    batch = build_selftest_batch(spec, layout.cp_size, ps)
    gen = torch.Generator().manual_seed(spec.seed)
    num_logical_pages = layout.cp_size * (batch.physical_pages + 1)
    replicated = SelfTestPool(geometry, num_logical_pages, spec.num_layers, device)
    shared = SelfTestPool(geometry, batch.physical_pages + 1, spec.num_layers, device)

    capacity = logical_capacity_tokens(shared.size, layout) + ps
    stage.check(
        "logical_capacity",
        batch.max_logical_loc() < capacity,
        f"logical loc {batch.max_logical_loc()} is outside the logical view's capacity {capacity}",
    )
    view_capacity = hooks.logical_capacity_size(shared, layout) + ps
    stage.check(
        "logical_capacity",
        view_capacity == capacity,
        f"the hooks' logical pool view reports capacity {view_capacity}, expected {capacity}",
    )

    prefix = torch.as_tensor(batch.prefix_locs(), device=device)
    chunk = torch.as_tensor(batch.chunk_locs(), device=device)
    layers = range(spec.num_layers)
    prefix_rows = [random_token_rows(geometry, len(prefix), gen, device) for _ in layers]
    chunk_rows = [random_token_rows(geometry, len(chunk), gen, device) for _ in layers]
    for layer in layers:
        for locs, rows in ((prefix, prefix_rows[layer]), (chunk, chunk_rows[layer])):
            write_tokens(replicated.kv_buffer[layer], replicated.index_k_with_scale_buffer[layer], ps, locs, rows)
            write_tokens(
                shared.kv_buffer[layer], shared.index_k_with_scale_buffer[layer], ps,
                translate_out_cache_loc(layout, locs), rows,
            )

    # write_translation: each owned page holds the replicated bytes; nothing else is written.
    replicated_reader, shared_reader = PoolPageReader(replicated), PoolPageReader(shared)
    batch_pages = np.unique(np.concatenate(batch.request_pages))
    owned_logical = batch_pages[layout.owner_for_logical_pages(batch_pages) == layout.cp_rank]
    owned_physical = torch.as_tensor(layout.logical_pages_to_physical(owned_logical), device=device)
    owned_logical_t = torch.as_tensor(owned_logical, device=device)
    for layer in layers:
        stage.equal(
            "write_translation",
            [shared_reader.kv_pages(layer)[owned_physical], shared_reader.index_pages(layer)[owned_physical]],
            [replicated_reader.kv_pages(layer)[owned_logical_t], replicated_reader.index_pages(layer)[owned_logical_t]],
        )
        unowned = torch.ones(shared.num_pages, dtype=torch.bool, device=device)
        unowned[0] = False
        unowned[owned_physical] = False
        stage.check(
            "write_translation",
            not bool(shared_reader.kv_pages(layer)[unowned].any()),
            f"layer {layer}: physical pages outside this rank's owned pages were written",
        )

    mapping = build_batch_mapping(
        layout, list(batch.request_pages), list(batch.prefix_lens), device
    )
    materializer = make_strategy(strategy, group)
    dense_out_cache_loc = mapping.remap_logical_locs(chunk)
    dense_pages_logical = torch.empty(mapping.num_dense_pages, dtype=torch.int64, device=device)
    dense_pages_logical[0] = 0
    dense_pages_logical[mapping.remap_logical_pages(mapping.sorted_logical_pages)] = mapping.sorted_logical_pages
    prefix_range = mapping.plan.prefix_dense_range
    replicated_side = None
    for layer in layers:
        dense: DenseLayerKV = materializer.launch(mapping, shared_reader, layer).wait()
        expected_kv = replicated_reader.kv_pages(layer)[dense_pages_logical]
        expected_index = replicated_reader.index_pages(layer)[dense_pages_logical]
        stage.equal(
            f"materialize_{strategy}",
            [dense.kv_pages[prefix_range], dense.index_pages[prefix_range]],
            [expected_kv[prefix_range], expected_index[prefix_range]],
        )
        outside = torch.ones(mapping.num_dense_pages, dtype=torch.bool, device=device)
        outside[prefix_range] = False
        stage.check(
            "dense_buffer_clean",
            not bool(dense.kv_pages[outside].any()) and not bool(dense.index_pages[outside].any()),
            f"layer {layer}: dense pages outside the prefix hold stale bytes before the chunk store",
        )
        write_tokens(dense.kv_buffer, dense.index_buffer, ps, dense_out_cache_loc, chunk_rows[layer])
        expected_kv[0].zero_()
        expected_index[0].zero_()
        stage.equal("chunk_store", [dense.kv_pages, dense.index_pages], [expected_kv, expected_index])
        if layer == 0:
            replicated_side = _read_side(replicated, replicated.kv_buffer[0], replicated.index_k_with_scale_buffer[0], batch, None, device)
            shared_side = _read_side(shared, dense.kv_buffer, dense.index_buffer, batch, mapping, device)
            _compare_readers(stage, kernels, replicated_side, shared_side, mapping, batch, gen, device)
    return report


def _read_side(pool, kv, index, batch, mapping, device) -> ReadSide:
    page_table_1, real = _page_tables(batch, device, mapping)
    extend_lens = tuple(s - p for s, p in zip(batch.seq_lens, batch.prefix_lens))
    return ReadSide(pool, kv, index, page_table_1, real, torch.tensor(batch.seq_lens, dtype=torch.int32, device=device), extend_lens)


def _compare_readers(stage, kernels, replicated, shared, mapping, batch, gen, device) -> None:
    stage.equal("GetKAndS", kernels.get_k_and_s(shared), kernels.get_k_and_s(replicated))
    stage.equal("GetK/GetS", kernels.get_k_get_s(shared), kernels.get_k_get_s(replicated))
    # Causal lengths of each chunk token, scores over its request's keys.
    lengths = torch.cat(
        [torch.arange(p + 1, s + 1) for p, s in zip(batch.prefix_lens, batch.seq_lens)]
    ).to(torch.int32).to(device)
    scores = torch.randn(int(lengths.numel()), max(batch.seq_lens), generator=gen).to(device)
    topk = getattr(kernels, "topk", 2048)
    replicated_idx = kernels.topk_transform(replicated, scores, lengths, topk)
    shared_idx = kernels.topk_transform(shared, scores, lengths, topk)
    expected = torch.where(replicated_idx >= 0, mapping.remap_logical_locs(replicated_idx.clamp(min=0)), replicated_idx)
    stage.equal("topk_transform", [shared_idx], [expected.to(shared_idx.dtype)])
    heads = getattr(kernels, "num_heads", 64)
    q = torch.randn(int(lengths.numel()), heads, KV_LORA_RANK + 64, generator=gen).to(torch.bfloat16).to(device)
    stage.equal("sparse_attention", [kernels.sparse_attention(shared, q, shared_idx)], [kernels.sparse_attention(replicated, q, replicated_idx)])
    kv_shared = kernels.sparse_attention_kv(shared, q, shared_idx, lengths)
    if kv_shared is not None:
        stage.equal("flashmla_kv", [kv_shared], [kernels.sparse_attention_kv(replicated, q, replicated_idx, lengths)])
    flat_replicated = torch.cat([replicated.page_table_1[i, :n] for i, n in enumerate(batch.seq_lens)])
    flat_shared = torch.cat([shared.page_table_1[i, :n] for i, n in enumerate(batch.seq_lens)])
    deq_shared = kernels.dequantize_paged(shared, flat_shared)
    if deq_shared is not None:
        stage.equal("dequantize_k_cache_paged", [deq_shared], [kernels.dequantize_paged(replicated, flat_replicated)])


def materialization_round_trip(
    geometry: PagedLayerGeometry, layout: CpSharedKVLayout, group: Any, strategy: str, device: torch.device,
    num_pages_per_rank: int = 5, report: Optional[SelfTestReport] = None,
) -> SelfTestReport:
    """Stage (b): each rank fills its owned pages with ``f(logical page, byte)``; after
    materialising, every dense page must carry its logical page's pattern."""
    report = report or SelfTestReport()
    stage = _Stage(report)
    pool = SelfTestPool(geometry, num_pages_per_rank + 1, 1, device)
    logical_pages = np.arange(layout.cp_size, layout.cp_size * (num_pages_per_rank + 1), dtype=np.int64)
    reader = PoolPageReader(pool)
    owned = logical_pages[layout.owner_for_logical_pages(logical_pages) == layout.cp_rank]
    physical = torch.as_tensor(layout.logical_pages_to_physical(owned), device=device)
    reader.kv_pages(0)[physical] = _page_pattern(torch.as_tensor(owned, device=device), geometry.kv_page_bytes, 0)
    reader.index_pages(0)[physical] = _page_pattern(torch.as_tensor(owned, device=device), geometry.index_page_bytes, 101)
    # One request holding all pages as cached prefix (its last page is partial).
    mapping = build_batch_mapping(layout, [logical_pages], [len(logical_pages) * layout.page_size - 1], device)
    dense = make_strategy(strategy, group).launch(mapping, reader, 0).wait()
    dense_pages = mapping.remap_logical_pages(torch.as_tensor(logical_pages, device=device))
    stage.equal(
        "round_trip",
        [dense.kv_pages[dense_pages], dense.index_pages[dense_pages]],
        [
            _page_pattern(torch.as_tensor(logical_pages, device=device), geometry.kv_page_bytes, 0),
            _page_pattern(torch.as_tensor(logical_pages, device=device), geometry.index_page_bytes, 101),
        ],
    )
    return report


def _page_pattern(logical_pages: torch.Tensor, page_bytes: int, salt: int) -> torch.Tensor:
    byte = torch.arange(page_bytes, device=logical_pages.device)
    return ((logical_pages[:, None] * 131 + byte[None, :] * 7 + salt) % 251 + 1).to(torch.uint8)


def run_selftest(
    geometry: PagedLayerGeometry,
    layout: CpSharedKVLayout,
    group: Any,
    strategy: str,
    device: torch.device,
    kernels: Optional[ReaderKernels] = None,
) -> SelfTestReport:
    """Both checks; raise :class:`SharedKVSelfTestFailed` naming the first bad stage."""
    start = time.perf_counter()
    report = SelfTestReport()
    kernels = kernels or default_reader_kernels(device)
    run_kernel_equivalence(geometry, layout, group, strategy, kernels, device, report=report)
    materialization_round_trip(geometry, layout, group, strategy, device, report=report)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    report.seconds = time.perf_counter() - start
    return report


def run_startup_selftest(model_runner: Any, runtime: Any) -> SelfTestReport:
    """Every rank, at init: the self-test on this rank's device, CP group and KV geometry."""
    pool = model_runner.token_to_kv_pool
    geometry = PagedLayerGeometry.of_pool(pool)
    device = pool.kv_buffer[0].device
    report = run_selftest(geometry, runtime.layout, runtime.group, runtime.strategy, device)
    log = logger.warning if report.seconds > SELFTEST_BUDGET_S else logger.info
    log(
        "CP shared KV startup self-test passed on rank %d/%d in %.3f s (budget %.1f s; "
        "kv %s %s, materialise=%s): %s",
        runtime.layout.cp_rank, runtime.layout.cp_size, report.seconds, SELFTEST_BUDGET_S,
        geometry.kv_store_dtype, geometry.kv_token_shape, runtime.strategy, ", ".join(dict.fromkeys(report.stages)),
    )
    return report


SELFTEST_ATTR = "cp_shared_kv_selftest"


def init_memory_pool_around(original: Callable, self: Any, *args, **kwargs) -> Any:
    """AROUND ``ModelRunnerKVCacheMixin.init_memory_pool``: after the pools exist, the
    startup self-test on this rank's GPU and CP group.

    Raises :class:`SharedKVSelfTestFailed` (naming the stage) before the rank serves.
    """
    result = original(self, *args, **kwargs)
    if getattr(self, "is_draft_worker", False):
        return result
    runtime = hooks.startup_runtime(self)
    if runtime is not None:
        setattr(self, SELFTEST_ATTR, run_startup_selftest(self, runtime))
    return result
