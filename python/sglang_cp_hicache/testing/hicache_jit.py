"""Pure-torch stand-ins of the compiled modules behind SGLang 0.5.23's JIT HiCache transfer
wrappers (``sglang/kernels/ops/kvcache/hicache.py``), for machines without a GPU.

Only the compiled part is replaced. The Python wrappers run as shipped (for
``transfer_hicache_one_layer_mla``: ``.view(-1, element_dim)`` of both caches, the element
size from ``element_dim * cache_dst.element_size()``, the choice between the TMA kernel and the
register kernel). The CPU runtime binds, in that module, ``_jit_hicache_module`` to
:func:`register_module`, ``_jit_hicache_tma_module`` to :func:`tma_module` and
``use_hicache_tma_kernel`` to a :func:`tma_selector`, which answers as an sm_90 part (H100,
H200: the project's GPU checks) with enough shared memory for the TMA ring would.

Two entry points are stood in. ``launch_one_mla``: one layer, one ``element_size``-byte row
per index pair, ``dst_row(indices_dst[i]) = src_row(indices_src[i])``; a row of a ``[-1, D]``
cache is addressed as the C++ does, ``data_ptr + index * stride(0) * element_size``.
``launch_all_mla``: the same for every layer ``l`` of two uint64 pointer tables, a row at
``table[l] + index * stride_bytes`` (the host pools' all-layer backup once ``can_use_jit``
holds). Any other entry point raises ``NotImplementedError`` naming itself.

Exactly as strict as the C++ (``kvcacheio/hicache.cuh`` ``HiCacheKernel::run_one_mla``,
``kvcacheio/hicache_tma.cuh`` ``HiCacheTmaKernel::run_one_impl`` and ``launch``); a call the
real module would refuse, or run into a fault or a silent misread, raises here
(``ValueError``/``TypeError``/``IndexError``/``RuntimeError`` naming the module):

* both kernels (``TensorMatcher``): each cache 2-D ``[-1, D]`` with ``stride(1) == 1`` (not
  checked when ``D == 1``), the same ``D`` and dtype on both sides, on the kernel's device
  or host (here: CPU); indices 1-D, **contiguous** (a matcher without strides demands it),
  int32 or int64, one dtype and one device for both (the GPU's; here :data:`KERNEL_DEVICE`),
  equal lengths; the module's element size equal to ``D * dtype size``.
* every index in ``[0, rows)`` of its cache (the kernel has no bounds check: anything else
  reads or writes outside the tensor).
* register kernel: the module must build, i.e. ``element_size`` tiles the copy group (CUDA:
  a multiple of 128 bytes; ``pick_group_bytes``); every row address a multiple of its vector
  package (``4 * unroll`` bytes, "misaligned address" otherwise); **not empty** (a grid of 0
  blocks: "invalid configuration argument").
* ``launch_all_mla`` (both kernels): the pointer tables 1-D uint64 of one length on the
  kernel's device; the indices as above. A table holds raw addresses: rows are not
  bounds-checked against a tensor (the kernel cannot either), only against negative indices.
* TMA kernel: ``row_bytes`` a positive multiple of 16 and at most one 32 KiB stage; both row
  strides multiples of 16 bytes; base addresses 16-byte aligned (bulk copies; a strided
  source also gets a tensor map, whose base must be 16-byte aligned and whose row count must
  be positive); empty indices are a no-op, after the checks.

Not checkable here: that host memory is registered with CUDA (``get_device_accessible_ptr``;
the CPU runtime keeps every host pool pageable) and which stream the launch is ordered on (a
kernel launch, unlike ``cudaMemcpyBatchAsync``, accepts any stream). The GPU checks cover both.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Callable, Optional

import torch

Tensor = torch.Tensor

#: The device the stand-in kernels run on: indices must live there, like the GPU's.
KERNEL_DEVICE = torch.device("cpu")

#: The modelled part: CUDA (not ROCm), compute capability 9.x, TMA ring fits its smem.
COPY_GROUP_THREADS = 32  # hicache.cuh kCopyGroupThreads
CUDA_GROUP_BYTES = (128,)  # pick_group_bytes without USE_ROCM
TMA_STAGE_BYTES = 32 * 1024  # hicache.py TMA_STAGE_BYTES
TMA_MAX_ROWS = 4 * 32  # hicache_tma.cuh kHicacheTmaMaxRows
TMA_MAX_MAP_ROW_BYTES = 256 * 8  # kHicacheTmaMaxMapRowBytes
_TMA_ALIGN = 16


def tma_rows_per_chunk(row_bytes: int) -> int:
    """``hicache_tma_rows_per_chunk``: the largest power of two of rows that fits a stage."""
    rows = 1
    while rows * 2 <= TMA_STAGE_BYTES // row_bytes and rows * 2 <= TMA_MAX_ROWS:
        rows *= 2
    return rows


def tma_selector(tma_enabled: Callable[[], bool]) -> Callable[..., bool]:
    """``use_hicache_tma_kernel`` as the modelled sm_90 part answers it; ``tma_enabled``
    reads ``SGLANG_HICACHE_TMA_TRANSFER`` the way SGLang does."""

    def use_hicache_tma_kernel(
        *, element_size: int, block_quota: int, page_size: Optional[int] = None
    ) -> bool:
        if not tma_enabled() or element_size % 16 != 0:
            return False
        return page_size is None or page_size % tma_rows_per_chunk(element_size) == 0

    return use_hicache_tma_kernel


# --------------------------------------------------------------------------------------
# Operand checks shared by both kernels (TensorMatcher)
# --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Rows:
    """A ``[-1, D]`` cache as the kernel sees it: a base address and a byte stride."""

    tensor: Tensor
    row_bytes: int
    stride_bytes: int

    @property
    def num_rows(self) -> int:
        return self.tensor.shape[0]

    def addresses(self, index: Tensor) -> Tensor:
        return self.tensor.data_ptr() + index.to(torch.int64) * self.stride_bytes

    def as_bytes(self) -> Tensor:
        """uint8 ``[rows, row_bytes]`` alias: row ``i`` at ``i * stride_bytes`` bytes."""
        t = self.tensor
        size = t.element_size()
        raw = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return raw.as_strided(
            (t.shape[0], self.row_bytes), (self.stride_bytes, 1), t.storage_offset() * size
        )


def _cache_rows(what: str, name: str, t: Tensor) -> _Rows:
    if t.dim() != 2:
        raise ValueError(f"{what}: {name} must be 2-D [-1, D], got shape {tuple(t.shape)}")
    if t.shape[1] != 1 and t.stride(1) != 1:
        raise ValueError(f"{what}: {name} stride(1) must be 1, got strides {t.stride()}")
    if t.device.type != KERNEL_DEVICE.type:
        raise ValueError(f"{what}: {name} on {t.device}, not the kernel's device or host")
    size = t.element_size()
    return _Rows(t, t.shape[1] * size, t.stride(0) * size)


def _check_operands(
    what: str, element_size: int, cache_dst: Tensor, indices_dst: Tensor, cache_src: Tensor,
    indices_src: Tensor,
) -> tuple:  # fmt: skip
    src = _cache_rows(what, "cache_src", cache_src)
    dst = _cache_rows(what, "cache_dst", cache_dst)
    if cache_src.shape[1] != cache_dst.shape[1]:
        raise ValueError(f"{what}: row dims differ: src {cache_src.shape[1]}, dst {cache_dst.shape[1]}")
    if cache_src.dtype != cache_dst.dtype:
        raise TypeError(f"{what}: cache dtypes differ: src {cache_src.dtype}, dst {cache_dst.dtype}")
    _check_indices(what, indices_dst, indices_src)
    if dst.row_bytes != element_size:
        raise ValueError(f"{what}: cache dimension mismatch: rows of {dst.row_bytes} bytes, module built for {element_size}")
    return src, dst


def _check_indices(what: str, indices_dst: Tensor, indices_src: Tensor) -> None:
    for name, t in (("indices_src", indices_src), ("indices_dst", indices_dst)):
        if t.dim() != 1:
            raise ValueError(f"{what}: {name} must be 1-D, got shape {tuple(t.shape)}")
        if not t.is_contiguous():
            raise ValueError(f"{what}: {name} is not contiguous (strides {t.stride()})")
        if t.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{what}: {name} must be int32 or int64, got {t.dtype}")
        if t.device != KERNEL_DEVICE:
            raise ValueError(f"{what}: {name} on {t.device}, must be on {KERNEL_DEVICE} (the kernel's device)")
    if indices_src.dtype != indices_dst.dtype:
        raise TypeError(f"{what}: index dtypes differ: {indices_src.dtype} vs {indices_dst.dtype}")
    if indices_src.numel() != indices_dst.numel():
        raise ValueError(f"{what}: {indices_src.numel()} source vs {indices_dst.numel()} destination indices")


def _check_bounds(what: str, name: str, index: Tensor, rows: _Rows) -> None:
    if index.numel() == 0:
        return
    low, high = int(index.min()), int(index.max())
    if low < 0 or high >= rows.num_rows:
        raise IndexError(f"{what}: {name} range [{low}, {high}] outside the cache's [0, {rows.num_rows}) rows")


def _check_aligned(what: str, name: str, addresses: Tensor, alignment: int) -> None:
    misaligned = addresses % alignment != 0
    if bool(misaligned.any()):
        first = int(addresses[misaligned][0])
        raise ValueError(f"{what}: {name} row at {first:#x} is not {alignment}-byte aligned (misaligned address)")


def _copy_rows(src: _Rows, dst: _Rows, indices_src: Tensor, indices_dst: Tensor) -> None:
    """``dst[indices_dst[i]] = src[indices_src[i]]`` bytewise, gathered first."""
    rows = src.as_bytes().index_select(0, indices_src.to(torch.int64))
    dst.as_bytes().index_copy_(0, indices_dst.to(torch.int64), rows)


@dataclass(frozen=True)
class _TableRows:
    """Layer ``l`` of a uint64 pointer table: rows at ``table[l] + index * stride_bytes``."""

    addresses: tuple
    row_bytes: int
    stride_bytes: int

    def row_addresses(self, layer: int, index: Tensor) -> Tensor:
        return self.addresses[layer] + index.to(torch.int64) * self.stride_bytes

    def as_bytes(self, layer: int, index: Tensor) -> Tensor:
        """uint8 ``[max(index) + 1, row_bytes]`` alias of layer ``layer``'s rows."""
        rows = int(index.max()) + 1
        span = (rows - 1) * self.stride_bytes + self.row_bytes
        raw = torch.frombuffer((ctypes.c_uint8 * span).from_address(self.addresses[layer]), dtype=torch.uint8)
        return raw.as_strided((rows, self.row_bytes), (self.stride_bytes, 1))


def _check_tables(
    what: str, row_bytes: int, ptr_dst: Tensor, indices_dst: Tensor, ptr_src: Tensor,
    indices_src: Tensor, src_stride_bytes: int, dst_stride_bytes: int,
) -> tuple:  # fmt: skip
    """The all-layer ``TensorMatcher``s: tables ``[N]`` uint64 on the kernel's device (one
    ``N``), indices as for one layer, and no negative index (the rows have no bound)."""
    for name, t in (("ptr_src", ptr_src), ("ptr_dst", ptr_dst)):
        if t.dim() != 1:
            raise ValueError(f"{what}: {name} must be 1-D [num_layers], got shape {tuple(t.shape)}")
        if t.dtype != torch.uint64:
            raise TypeError(f"{what}: {name} must be uint64, got {t.dtype}")
        if t.device != KERNEL_DEVICE:
            raise ValueError(f"{what}: {name} on {t.device}, must be on {KERNEL_DEVICE} (the kernel's device)")
    if ptr_src.numel() != ptr_dst.numel():
        raise ValueError(f"{what}: num_layers differ: src table {ptr_src.numel()}, dst table {ptr_dst.numel()}")
    _check_indices(what, indices_dst, indices_src)
    for name, t in (("indices_src", indices_src), ("indices_dst", indices_dst)):
        if t.numel() and int(t.min()) < 0:
            raise IndexError(f"{what}: {name} holds a negative index")

    def rows(table: Tensor, stride: int) -> _TableRows:
        addresses = tuple(int(a) for a in table.tolist())
        if 0 in addresses:
            raise ValueError(f"{what}: null layer pointer in a table")
        return _TableRows(addresses, row_bytes, stride)

    return rows(ptr_src, src_stride_bytes), rows(ptr_dst, dst_stride_bytes)


def _copy_table_rows(src: _TableRows, dst: _TableRows, indices_src: Tensor, indices_dst: Tensor) -> None:
    """Every layer: ``dst[l][indices_dst[i]] = src[l][indices_src[i]]``, gathered first."""
    for layer in range(len(src.addresses)):
        rows = src.as_bytes(layer, indices_src).index_select(0, indices_src.to(torch.int64))
        dst.as_bytes(layer, indices_dst).index_copy_(0, indices_dst.to(torch.int64), rows)


class _Unsupported:
    """Entry points of the real module without a stand-in."""

    _NAME = "JIT HiCache"

    def __getattr__(self, name: str):
        if name.startswith("launch") or name == "fits_device":
            raise NotImplementedError(f"{self._NAME} stand-in: no CPU stand-in for {name}")
        raise AttributeError(name)


# --------------------------------------------------------------------------------------
# The register kernel (HiCacheKernel<kElementSize, kUnroll, kBlockQuota, 1024>)
# --------------------------------------------------------------------------------------


def _group_fits(element_size: int, lanes_per_worker: int, group: int) -> bool:
    if group % lanes_per_worker or element_size % group:
        return False
    return group // lanes_per_worker in (4, 8, 16)


class RegisterModule(_Unsupported):
    """The compiled ``HiCacheKernel`` for one ``(element_size, unroll, block_quota)``."""

    _NAME = "HiCacheKernel"

    def __init__(self, element_size: int, unroll: int, block_quota: int) -> None:
        if unroll <= 0 or unroll > COPY_GROUP_THREADS or COPY_GROUP_THREADS % unroll:
            raise RuntimeError(f"HiCacheKernel: unroll {unroll} does not divide the copy group (build fails)")
        lanes = COPY_GROUP_THREADS // unroll
        groups = [g for g in CUDA_GROUP_BYTES if _group_fits(element_size, lanes, g)]
        if not groups:
            raise RuntimeError(
                f"HiCacheKernel: no 4/8/16 B package tiles {element_size} B across {lanes} lanes "
                "(static_assert in load_vec: the module does not build)"
            )
        self.element_size = element_size
        self.package_bytes = groups[0] // lanes

    def launch_one_mla(
        self, cache_dst: Tensor, indices_dst: Tensor, cache_src: Tensor, indices_src: Tensor
    ) -> None:
        what = "HiCacheKernel::run_one_mla"
        src, dst = _check_operands(what, self.element_size, cache_dst, indices_dst, cache_src, indices_src)
        if indices_src.numel() == 0:
            raise RuntimeError(f"{what}: empty indices launch a grid of 0 blocks (CUDA: invalid configuration argument)")
        _check_bounds(what, "indices_src", indices_src, src)
        _check_bounds(what, "indices_dst", indices_dst, dst)
        _check_aligned(what, "source", src.addresses(indices_src), self.package_bytes)
        _check_aligned(what, "destination", dst.addresses(indices_dst), self.package_bytes)
        _copy_rows(src, dst, indices_src, indices_dst)


    def launch_all_mla(
        self, ptr_dst: Tensor, indices_dst: Tensor, ptr_src: Tensor, indices_src: Tensor,
        src_stride_bytes: int, dst_stride_bytes: int,
    ) -> None:  # fmt: skip
        what = "HiCacheKernel::run_all_mla"
        src, dst = _check_tables(what, self.element_size, ptr_dst, indices_dst, ptr_src, indices_src,
                                 src_stride_bytes, dst_stride_bytes)  # fmt: skip
        if indices_src.numel() == 0:
            raise RuntimeError(f"{what}: empty indices launch a grid of 0 blocks (CUDA: invalid configuration argument)")
        for layer in range(len(src.addresses)):
            _check_aligned(what, "source", src.row_addresses(layer, indices_src), self.package_bytes)
            _check_aligned(what, "destination", dst.row_addresses(layer, indices_dst), self.package_bytes)
        _copy_table_rows(src, dst, indices_src, indices_dst)


def register_module(*, element_size: int, unroll: int, block_quota: int) -> RegisterModule:
    """Stand-in of ``hicache._jit_hicache_module``."""
    return RegisterModule(element_size, unroll, block_quota)


# --------------------------------------------------------------------------------------
# The TMA kernel (HiCacheTmaKernel<32 KiB, 6, 4, kBlockQuota>)
# --------------------------------------------------------------------------------------


class TmaModule(_Unsupported):
    """The compiled ``HiCacheTmaKernel`` (row size is a runtime parameter)."""

    _NAME = "HiCacheTmaKernel"

    def launch_one_mla(
        self, cache_dst: Tensor, indices_dst: Tensor, cache_src: Tensor, indices_src: Tensor
    ) -> None:
        what = "HiCacheTmaKernel::run_one_mla"
        src, dst = _check_operands(what, cache_dst.shape[1] * cache_dst.element_size(),
                                   cache_dst, indices_dst, cache_src, indices_src)  # fmt: skip
        row_bytes = src.row_bytes
        if src.stride_bytes != row_bytes and row_bytes <= TMA_MAX_MAP_ROW_BYTES:
            # encode_src_map: cuTensorMapEncodeTiled needs a 16-byte aligned base, rows > 0
            if cache_src.data_ptr() % _TMA_ALIGN or src.num_rows == 0:
                raise RuntimeError(f"{what}: cuTensorMapEncodeTiled failed (base {cache_src.data_ptr():#x}, {src.num_rows} rows)")
        if row_bytes == 0 or row_bytes % 16:
            raise RuntimeError(f"{what}: row bytes must be a multiple of 16, got {row_bytes}")
        if row_bytes > TMA_STAGE_BYTES:
            raise RuntimeError(f"{what}: row bytes {row_bytes} exceed the smem stage")
        if src.stride_bytes % 16 or dst.stride_bytes % 16:
            raise RuntimeError(f"{what}: strides must be multiples of 16 (src {src.stride_bytes}, dst {dst.stride_bytes})")
        if indices_src.numel() == 0:
            return
        _check_bounds(what, "indices_src", indices_src, src)
        _check_bounds(what, "indices_dst", indices_dst, dst)
        _check_aligned(what, "source", src.addresses(indices_src), _TMA_ALIGN)
        _check_aligned(what, "destination", dst.addresses(indices_dst), _TMA_ALIGN)
        _copy_rows(src, dst, indices_src, indices_dst)


    def launch_all_mla(
        self, ptr_dst: Tensor, indices_dst: Tensor, ptr_src: Tensor, indices_src: Tensor,
        src_stride_bytes: int, dst_stride_bytes: int, row_bytes: int,
    ) -> None:  # fmt: skip
        what = "HiCacheTmaKernel::run_all_mla"
        src, dst = _check_tables(what, row_bytes, ptr_dst, indices_dst, ptr_src, indices_src,
                                 src_stride_bytes, dst_stride_bytes)  # fmt: skip
        if row_bytes <= 0 or row_bytes % 16:
            raise RuntimeError(f"{what}: row bytes must be a multiple of 16, got {row_bytes}")
        if row_bytes > TMA_STAGE_BYTES:
            raise RuntimeError(f"{what}: row bytes {row_bytes} exceed the smem stage")
        if src_stride_bytes % 16 or dst_stride_bytes % 16:
            raise RuntimeError(f"{what}: strides must be multiples of 16 (src {src_stride_bytes}, dst {dst_stride_bytes})")
        if indices_src.numel() == 0 or not src.addresses:
            return
        for layer in range(len(src.addresses)):
            _check_aligned(what, "source", src.row_addresses(layer, indices_src), _TMA_ALIGN)
            _check_aligned(what, "destination", dst.row_addresses(layer, indices_dst), _TMA_ALIGN)
        _copy_table_rows(src, dst, indices_src, indices_dst)


def tma_module(*, block_quota: int) -> TmaModule:
    """Stand-in of ``hicache._jit_hicache_tma_module``."""
    return TmaModule()


__all__ = [
    "KERNEL_DEVICE",
    "RegisterModule",
    "TmaModule",
    "register_module",
    "tma_module",
    "tma_rows_per_chunk",
    "tma_selector",
]
