"""Pure-torch reference of the ``sgl_kernel.kvcacheio`` transfer ops, for machines without a GPU.

The CPU runtime (:mod:`sglang_cp_hicache.testing`) registers this module as
``sgl_kernel.kvcacheio`` when the real kernel package cannot load. Signatures match the
Python wrappers of sglang-kernel 0.4.x; semantics follow ``csrc/kvcacheio/transfer.cu``.

Two families of ops:

* **kernel** ops copy ``item_size``-byte items. An item is addressed in bytes from a base
  pointer, ignoring the tensor's shape and strides exactly as the CUDA kernel does:

  - layer_first (lf):  ``base + index * item_size``
  - page_first  (pf):  ``base + index * layout_dim + layer_id * item_size``
  - page_head   (ph):  item split into ``head_num`` heads of ``item_size / head_num`` bytes;
    head ``h`` of token ``p`` lives at ``base + (p // page_size) * page_size * layout_dim
    + h * (layout_dim / head_num) * page_size + (p % page_size) * (layout_dim / head_num)
    + layer_id * item_size / head_num``
  - pointer table (tbl): lf addressing from ``table[layer_id]``, a raw address held in a
    uint64 tensor (the all-layer ops).

  Tensor bases are bounds-checked against the bytes the tensor spans; pointer-table bases
  cannot be and are trusted like the kernel trusts them.

* **direct** ops copy whole rows along dim 0 with ``Tensor.copy_`` over maximal runs of
  consecutive indices, like ``transfer_page_direct`` in the C++ source.

Never more forgiving than sglang-kernel 0.4.2.post2: where the real launcher raises, crashes
or misreads, the stand-in raises (``ValueError``/``TypeError``/``IndexError`` naming the op):

* kernel ops (the shared launcher): index tensors int64, on the stand-in's device (see
  :data:`KERNEL_DEVICE`), contiguous (the kernel reads ``data_ptr`` in memory order), equal
  lengths, **not empty** (the launcher computes ``div_up(0, 0)``: SIGFPE), **no negative
  index** (the sm_90 kernel has no skip and addresses memory before the base);
  ``item_size % 8 == 0``; pointer tables uint64.
* direct ops: index tensors int64 (the C++ reads ``data_ptr<int64_t>()``), contiguous (``.cpu()``
  of a CPU tensor is the tensor itself, read in memory order), no negative index (a negative
  slice start wraps around), runs inside both buffers. Empty indices are a no-op, as in C++.
* page-first direct ops additionally check what ``cudaMemcpyBatchAsync`` relies on: it copies
  ``page_size * stride(0) * element_size`` bytes per page and layer from addresses computed
  with the strides of ``ptrs[0]`` only (see :func:`_check_page_first_direct`), on the
  current stream, which must not be the legacy default stream (see
  :func:`require_side_stream`; seen on an H200, CUDA 13: "invalid argument").
"""

from __future__ import annotations

import ctypes
from typing import Callable, List, Sequence, Tuple, Union

import torch

from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE

Tensor = torch.Tensor


def is_hip() -> bool:
    """Whether torch was built for ROCm (kept for parity with the real module)."""
    return torch.version.hip is not None


_is_hip = is_hip()

# Upper bound for index checks that only need to reject negative indices.
_ANY_ROW = 1 << 62

# The launcher requires CUDA index tensors: indices on the GPU that runs the kernel, even when
# one side of the copy is pinned host memory. The stand-in runs that "GPU" on the CPU (it is
# registered only where CUDA is unavailable), so kernel-op indices must be CPU tensors here;
# a CUDA or meta index tensor is refused as the launcher refuses a host one.
KERNEL_DEVICE = torch.device("cpu")


# --------------------------------------------------------------------------------------
# Item views: a byte-addressed set of equally sized items, gathered/scattered by index.
# --------------------------------------------------------------------------------------


class _StridedItems:
    """Items as rows of a 2-D uint8 view: row ``i`` starts at ``start + i * stride``."""

    def __init__(self, rows: Tensor, what: str):
        self.rows = rows
        self.what = what

    def gather(self, idx: Tensor) -> Tensor:
        _check_bounds(idx, self.rows.shape[0], self.what)
        return self.rows.index_select(0, idx.to(self.rows.device))

    def scatter(self, idx: Tensor, values: Tensor) -> None:
        _check_bounds(idx, self.rows.shape[0], self.what)
        self.rows.index_copy_(0, idx.to(self.rows.device), values.to(self.rows.device))


class _PageHeadItems:
    """Items in page_head layout: a uint8 view ``[page, slot, head, head_bytes]`` of one layer."""

    def __init__(self, pages: Tensor, what: str):
        self.pages = pages
        self.what = what

    def _locate(self, idx: Tensor) -> Tuple[Tensor, Tensor]:
        page_size = self.pages.shape[1]
        _check_bounds(idx, self.pages.shape[0] * page_size, self.what)
        idx = idx.to(self.pages.device)
        return torch.div(idx, page_size, rounding_mode="floor"), idx % page_size

    def gather(self, idx: Tensor) -> Tensor:
        page, slot = self._locate(idx)
        return self.pages[page, slot].reshape(idx.numel(), -1)

    def scatter(self, idx: Tensor, values: Tensor) -> None:
        page, slot = self._locate(idx)
        heads = values.to(self.pages.device).view(idx.numel(), *self.pages.shape[2:])
        self.pages[page, slot] = heads


def _check_bounds(idx: Tensor, limit: int, what: str) -> None:
    """Raise ``IndexError`` unless every index lies in ``[0, limit)``."""
    if idx.numel() == 0:
        return
    low, high = int(idx.min()), int(idx.max())
    if low < 0 or high >= limit:
        raise IndexError(f"{what}: index range [{low}, {high}] outside [0, {limit})")


def _byte_span(t: Tensor) -> Tensor:
    """1-D uint8 alias of the bytes reachable from ``t.data_ptr()`` through ``t``'s strides."""
    if t.numel() == 0:
        extent = 0
    else:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        extent = (last + 1) * t.element_size()
    span = torch.empty(0, dtype=torch.uint8, device=t.device)
    return span.set_(t.untyped_storage(), t.storage_offset() * t.element_size(), (extent,), (1,))


def _strided_view(
    span: Tensor, offset: int, inner_sizes: Sequence[int], inner_strides: Sequence[int], stride: int
) -> Tensor:
    """View ``[count, *inner_sizes]`` of ``span`` with outer byte ``stride`` starting at byte
    ``offset``; ``count`` is the largest number of outer steps that stays inside ``span``."""
    inner_extent = 1 + sum((n - 1) * s for n, s in zip(inner_sizes, inner_strides))
    room = span.numel() - offset - inner_extent
    count = room // stride + 1 if room >= 0 else 0
    # as_strided's storage_offset is absolute in the storage, not relative to ``span``.
    return span.as_strided(
        (count, *inner_sizes), (stride, *inner_strides), span.storage_offset() + offset
    )


def _lf_items(t: Tensor, item_size: int, what: str) -> _StridedItems:
    """layer_first item ``i`` of one layer: ``t.data_ptr() + i * item_size``."""
    return _StridedItems(_strided_view(_byte_span(t), 0, (item_size,), (1,), item_size), what)


def _pf_items(
    t: Tensor, layer_id: int, item_size: int, layout_dim: int, what: str
) -> _StridedItems:
    """page_first item ``i``: ``t.data_ptr() + i * layout_dim + layer_id * item_size``."""
    view = _strided_view(_byte_span(t), layer_id * item_size, (item_size,), (1,), layout_dim)
    return _StridedItems(view, what)


def _ph_items(
    t: Tensor,
    layer_id: int,
    item_size: int,
    layout_dim: int,
    page_size: int,
    head_num: int,
    what: str,
) -> _PageHeadItems:
    """page_head items of ``layer_id`` in a ``[page, head, slot, layer, head_bytes]`` buffer."""
    if item_size % head_num or layout_dim % head_num:
        raise ValueError(f"{what}: item_size and layout_dim must divide by head_num={head_num}")
    head_bytes = item_size // head_num
    if head_bytes % 8:
        # The CUDA kernel copies whole 8-byte words per head and would drop the tail.
        raise ValueError(f"{what}: per-head size {head_bytes} bytes is not a multiple of 8")
    slot_stride = layout_dim // head_num
    view = _strided_view(
        _byte_span(t),
        layer_id * head_bytes,
        (page_size, head_num, head_bytes),
        (slot_stride, slot_stride * page_size, 1),
        page_size * layout_dim,
    )
    return _PageHeadItems(view, what)


def _table_addresses(table: Tensor, num_layers: int, what: str) -> List[int]:
    """Per-layer base addresses from a uint64 pointer table (on :data:`KERNEL_DEVICE`)."""
    if table.dtype != torch.uint64:  # the launcher reads data_ptr<uintptr_t>()
        raise TypeError(f"{what}: pointer table must be uint64, got {table.dtype}")
    if table.device.type != "cpu":
        raise RuntimeError(f"{what}: the CPU reference cannot dereference {table.device} pointers")
    addresses = [int(a) for a in table.reshape(-1).tolist()]
    if len(addresses) < num_layers:
        raise ValueError(f"{what}: pointer table has {len(addresses)} entries, need {num_layers}")
    if any(a == 0 for a in addresses[:num_layers]):
        raise ValueError(f"{what}: null layer pointer")
    return addresses[:num_layers]


def _table_items(address: int, item_size: int, idx: Tensor, what: str) -> _StridedItems:
    """layer_first items at a raw address; spans exactly the rows ``idx`` reaches, since a
    bare pointer carries no size to check against."""
    _check_bounds(idx, _ANY_ROW, what)  # negative rows would address memory before the base
    num_rows = int(idx.max()) + 1
    raw = (ctypes.c_uint8 * (num_rows * item_size)).from_address(address)
    rows = torch.frombuffer(raw, dtype=torch.uint8).view(num_rows, item_size)
    return _StridedItems(rows, what)


def _check_index_dtype(op: str, name: str, t: Tensor) -> None:
    if t.dtype != torch.int64:
        raise TypeError(f"{op}: {name} must be int64, got {t.dtype}")


def _check_index_layout(op: str, name: str, t: Tensor) -> None:
    """The C++ reads ``data_ptr<int64_t>()`` in memory order, not in logical order."""
    if not t.is_contiguous():
        raise ValueError(
            f"{op}: {name} is not contiguous (strides {t.stride()}); the real op would read "
            "it in raw memory order"
        )


def _check_not_negative(op: str, name: str, t: Tensor) -> None:
    if t.numel() and int(t.min()) < 0:
        raise IndexError(f"{op}: {name} holds negative index {int(t.min())}")


def _kernel_indices(
    op: str, src_indices: Tensor, dst_indices: Tensor, item_size: int
) -> Tuple[Tensor, Tensor]:
    """Validate kernel-op indices as the launcher does, and refuse what it would crash on
    or misread; return them flattened."""
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        if t.device != KERNEL_DEVICE:
            raise ValueError(
                f"{op}: {name} must be on {KERNEL_DEVICE} (the kernel's device), got {t.device}"
            )
        _check_index_dtype(op, name, t)
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{op}: src_indices and dst_indices must have the same length")
    if item_size % 8:
        raise ValueError(f"{op}: item_size {item_size} is not divisible by 8")
    if src_indices.numel() == 0:
        raise ValueError(
            f"{op}: empty index tensors (the real launcher computes div_up(0, 0) and dies "
            "with SIGFPE); the caller must skip the transfer"
        )
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        _check_index_layout(op, name, t)
        _check_not_negative(op, name, t)
    return src_indices.reshape(-1), dst_indices.reshape(-1)


_Items = Union[_StridedItems, _PageHeadItems]


def _copy_items(src: _Items, dst: _Items, src_idx: Tensor, dst_idx: Tensor) -> None:
    """``dst[dst_idx[i]] = src[src_idx[i]]`` item-wise (gather first, so overlap is safe)."""
    dst.scatter(dst_idx, src.gather(src_idx))


def _check_num_layers(table: Tensor, num_layers: int, what: str) -> None:
    if table.shape[0] != num_layers:
        raise ValueError(f"Number of layers in {what} does not match num_layers")


# --------------------------------------------------------------------------------------
# Kernel ops, one layer
# --------------------------------------------------------------------------------------


def transfer_kv_per_layer(
    src_k: Tensor,
    dst_k: Tensor,
    src_v: Tensor,
    dst_v: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, lf -> lf: item ``i`` at ``base + i * item_size`` on both sides."""
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_per_layer", src_indices, dst_indices, item_size
    )
    for name, src, dst in (("k", src_k, dst_k), ("v", src_v, dst_v)):
        _copy_items(
            _lf_items(src, item_size, f"transfer_kv_per_layer src_{name}"),
            _lf_items(dst, item_size, f"transfer_kv_per_layer dst_{name}"),
            src_idx,
            dst_idx,
        )


def transfer_kv_per_layer_pf_lf(
    src_k: Tensor,
    dst_k: Tensor,
    src_v: Tensor,
    dst_v: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, pf -> lf: src ``base + i * src_layout_dim + layer_id * item_size``,
    dst ``base + i * item_size`` (dst is the one layer's buffer)."""
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_per_layer_pf_lf", src_indices, dst_indices, item_size
    )
    for name, src, dst in (("k", src_k, dst_k), ("v", src_v, dst_v)):
        what = f"transfer_kv_per_layer_pf_lf {{}}_{name}"
        _copy_items(
            _pf_items(src, layer_id, item_size, src_layout_dim, what.format("src")),
            _lf_items(dst, item_size, what.format("dst")),
            src_idx,
            dst_idx,
        )


def transfer_kv_per_layer_ph_lf(
    src_k: Tensor,
    dst_k: Tensor,
    src_v: Tensor,
    dst_v: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, ph -> lf: src heads of token ``i`` in page_head layout for ``layer_id``,
    dst ``base + i * item_size`` with heads contiguous."""
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_per_layer_ph_lf", src_indices, dst_indices, item_size
    )
    for name, src, dst in (("k", src_k, dst_k), ("v", src_v, dst_v)):
        what = f"transfer_kv_per_layer_ph_lf {{}}_{name}"
        _copy_items(
            _ph_items(
                src, layer_id, item_size, src_layout_dim, page_size, head_num, what.format("src")
            ),
            _lf_items(dst, item_size, what.format("dst")),
            src_idx,
            dst_idx,
        )


def transfer_kv_per_layer_mla(
    src: Tensor,
    dst: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """One buffer, lf -> lf: item ``i`` at ``base + i * item_size`` on both sides."""
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_per_layer_mla", src_indices, dst_indices, item_size
    )
    _copy_items(
        _lf_items(src, item_size, "transfer_kv_per_layer_mla src"),
        _lf_items(dst, item_size, "transfer_kv_per_layer_mla dst"),
        src_idx,
        dst_idx,
    )


def transfer_kv_per_layer_mla_pf_lf(
    src: Tensor,
    dst: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    layer_id: int,
    item_size: int,
    src_layout_dim: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """One buffer, pf -> lf: src ``base + i * src_layout_dim + layer_id * item_size``,
    dst ``base + i * item_size``."""
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_per_layer_mla_pf_lf", src_indices, dst_indices, item_size
    )
    _copy_items(
        _pf_items(src, layer_id, item_size, src_layout_dim, "transfer_kv_per_layer_mla_pf_lf src"),
        _lf_items(dst, item_size, "transfer_kv_per_layer_mla_pf_lf dst"),
        src_idx,
        dst_idx,
    )


# --------------------------------------------------------------------------------------
# Kernel ops, all layers (source layers given as a uint64 pointer table)
# --------------------------------------------------------------------------------------


def _from_table(
    src_table: Tensor,
    num_layers: int,
    item_size: int,
    src_what: str,
    dst_items: Callable[[int], _Items],
    src_idx: Tensor,
    dst_idx: Tensor,
) -> None:
    """Each layer ``l``: the items at ``src_table[l] + i * item_size`` into ``dst_items(l)``."""
    for layer_id, src_addr in enumerate(_table_addresses(src_table, num_layers, src_what)):
        src = _table_items(src_addr, item_size, src_idx, src_what)
        _copy_items(src, dst_items(layer_id), src_idx, dst_idx)


def _table_to_table(
    src_table: Tensor,
    dst_table: Tensor,
    num_layers: int,
    item_size: int,
    what: str,
    src_idx: Tensor,
    dst_idx: Tensor,
) -> None:
    """tbl -> tbl: for each layer ``l``, ``table[l] + i * item_size`` on both sides (``what``
    formats ``src``/``dst`` into the messages)."""
    dst_addrs = _table_addresses(dst_table, num_layers, what.format("dst"))

    def dst_items(layer_id: int) -> _StridedItems:
        return _table_items(dst_addrs[layer_id], item_size, dst_idx, what.format("dst"))

    _from_table(src_table, num_layers, item_size, what.format("src"), dst_items, src_idx, dst_idx)


def transfer_kv_all_layer(
    src_k_layers: Tensor,
    dst_k_layers: Tensor,
    src_v_layers: Tensor,
    dst_v_layers: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, tbl -> tbl: for each layer ``l``, ``table[l] + i * item_size`` on both sides."""
    _check_num_layers(src_k_layers, num_layers, "source k tensor")
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_all_layer", src_indices, dst_indices, item_size
    )
    tables = (("k", src_k_layers, dst_k_layers), ("v", src_v_layers, dst_v_layers))
    for name, src_tbl, dst_tbl in tables:
        what = f"transfer_kv_all_layer {{}}_{name}_layers"
        _table_to_table(src_tbl, dst_tbl, num_layers, item_size, what, src_idx, dst_idx)


def transfer_kv_all_layer_lf_pf(
    src_k_layers: Tensor,
    dst_k: Tensor,
    src_v_layers: Tensor,
    dst_v: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, tbl -> pf: src ``table[l] + i * item_size``,
    dst ``base + i * dst_layout_dim + l * item_size``."""
    _check_num_layers(src_k_layers, num_layers, "source k tensor")
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_all_layer_lf_pf", src_indices, dst_indices, item_size
    )
    for name, src_tbl, dst in (("k", src_k_layers, dst_k), ("v", src_v_layers, dst_v)):
        what = f"transfer_kv_all_layer_lf_pf {{}}_{name}"
        dst_items = lambda layer_id: _pf_items(  # noqa: E731
            dst, layer_id, item_size, dst_layout_dim, what.format("dst")
        )
        _from_table(src_tbl, num_layers, item_size, what.format("src"), dst_items, src_idx, dst_idx)


def transfer_kv_all_layer_lf_ph(
    src_k_layers: Tensor,
    dst_k: Tensor,
    src_v_layers: Tensor,
    dst_v: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    page_size: int,
    head_num: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """K and V, tbl -> ph: src ``table[l] + i * item_size`` (heads contiguous),
    dst heads of token ``i`` in page_head layout for layer ``l``."""
    _check_num_layers(src_k_layers, num_layers, "source k tensor")
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_all_layer_lf_ph", src_indices, dst_indices, item_size
    )
    for name, src_tbl, dst in (("k", src_k_layers, dst_k), ("v", src_v_layers, dst_v)):
        what = f"transfer_kv_all_layer_lf_ph {{}}_{name}"
        dst_items = lambda layer_id: _ph_items(  # noqa: E731
            dst, layer_id, item_size, dst_layout_dim, page_size, head_num, what.format("dst")
        )
        _from_table(src_tbl, num_layers, item_size, what.format("src"), dst_items, src_idx, dst_idx)


def transfer_kv_all_layer_mla(
    src_layers: Tensor,
    dst_layers: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """One buffer per layer, tbl -> tbl: ``table[l] + i * item_size`` on both sides."""
    _check_num_layers(src_layers, num_layers, "source tensor")
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_all_layer_mla", src_indices, dst_indices, item_size
    )
    what = "transfer_kv_all_layer_mla {}_layers"
    _table_to_table(src_layers, dst_layers, num_layers, item_size, what, src_idx, dst_idx)


def transfer_kv_all_layer_mla_lf_pf(
    src_layers: Tensor,
    dst: Tensor,
    src_indices: Tensor,
    dst_indices: Tensor,
    item_size: int,
    dst_layout_dim: int,
    num_layers: int,
    block_quota: int = 2,
    num_warps_per_block: int = 16 if _is_hip else 32,
) -> None:
    """One buffer, tbl -> pf: src ``table[l] + i * item_size``,
    dst ``base + i * dst_layout_dim + l * item_size``."""
    _check_num_layers(src_layers, num_layers, "source tensor")
    src_idx, dst_idx = _kernel_indices(
        "transfer_kv_all_layer_mla_lf_pf", src_indices, dst_indices, item_size
    )
    what = "transfer_kv_all_layer_mla_lf_pf {}"
    dst_items = lambda layer_id: _pf_items(  # noqa: E731
        dst, layer_id, item_size, dst_layout_dim, what.format("dst")
    )
    src_what = what.format("src_layers")
    _from_table(src_layers, num_layers, item_size, src_what, dst_items, src_idx, dst_idx)


# --------------------------------------------------------------------------------------
# Direct ops: Tensor.copy_ of dim-0 row runs
# --------------------------------------------------------------------------------------


def _direct_indices(
    op: str, src_indices: Tensor, dst_indices: Tensor, page_size: int
) -> Tuple[Tensor, Tensor]:
    """Validate direct-op indices as the C++ does (and refuse what it would misread); return
    them flattened on the CPU. Any device is fine: the C++ calls ``.cpu()`` first."""
    if src_indices.numel() != dst_indices.numel():
        raise ValueError(f"{op}: src_indices and dst_indices must have the same length")
    if page_size <= 0:
        raise ValueError(f"{op}: page_size must be positive, got {page_size}")
    if src_indices.numel() % page_size:
        raise ValueError(f"{op}: {src_indices.numel()} indices are not whole pages of {page_size}")
    for name, t in (("src_indices", src_indices), ("dst_indices", dst_indices)):
        _check_index_dtype(op, name, t)  # data_ptr<int64_t>() raises on any other dtype
        # .cpu() of a CPU tensor is the tensor itself, read in memory order.
        if t.device.type == "cpu":
            _check_index_layout(op, name, t)
        # A negative start would wrap around in slicing.
        _check_not_negative(op, name, t)
    return src_indices.reshape(-1).cpu(), dst_indices.reshape(-1).cpu()


def _runs(src: Tensor, dst: Tensor, src_step: int, dst_step: int) -> List[Tuple[int, int, int]]:
    """Maximal runs ``(src_start, dst_start, count)`` over which ``src`` advances by
    ``src_step`` and ``dst`` by ``dst_step`` per element."""
    n = src.numel()
    if n == 0:
        return []
    breaks = ((src[1:] - src[:-1]) != src_step) | ((dst[1:] - dst[:-1]) != dst_step)
    starts = torch.cat([torch.zeros(1, dtype=torch.long), breaks.nonzero().reshape(-1) + 1])
    counts = torch.diff(starts, append=torch.tensor([n]))
    return list(zip(src[starts].tolist(), dst[starts].tolist(), counts.tolist()))


def _copy_rows(src: Tensor, dst: Tensor) -> None:
    """``dst.copy_(src)`` after checking the row counts match: slicing clips a run that
    overruns a buffer, and copy_ would then broadcast a single row or fail obscurely."""
    if src.shape[0] != dst.shape[0]:
        raise IndexError(f"direct transfer: run of {src.shape[0]} rows vs {dst.shape[0]} rows")
    dst.copy_(src, non_blocking=True)


def transfer_kv_direct(
    src_layers: List[Tensor],
    dst_layers: List[Tensor],
    src_indices: Tensor,
    dst_indices: Tensor,
    page_size: int,
) -> None:
    """For every layer ``j``: ``dst_layers[j][d] = src_layers[j][s]`` row-wise along dim 0,
    copied as runs where both index lists are consecutive."""
    if len(src_layers) != len(dst_layers):
        raise ValueError("Source and destination layers must have the same number of layers")
    src, dst = _direct_indices("transfer_kv_direct", src_indices, dst_indices, page_size)
    for s, d, n in _runs(src, dst, 1, 1):
        for src_layer, dst_layer in zip(src_layers, dst_layers):
            _copy_rows(src_layer[s : s + n], dst_layer[d : d + n])


def transfer_kv_per_layer_direct_pf_lf(
    src_ptrs: List[Tensor],
    dst_ptrs: List[Tensor],
    src_indices: Tensor,
    dst_indices: Tensor,
    layer_id: int,
    page_size: int,
) -> None:
    """page_first_direct -> lf. ``src_ptrs`` is ``[kv]`` (MLA) or ``[k, v]``, each
    ``[page, layer, page_size, ...]``; ``dst_ptrs`` is ``[layer_0..]`` or ``[k_0.., v_0..]``.
    Per page ``i``: ``dst[j][d : d + page_size] = src[src_indices[i*ps] // ps][layer_id + j]``
    with ``d = dst_indices[i*ps]``."""
    op = "transfer_kv_per_layer_direct_pf_lf"
    src, dst = _direct_indices(op, src_indices, dst_indices, page_size)
    num_layers = _check_page_first_direct(op, src_ptrs, dst_ptrs, src_indices, page_size)
    require_side_stream(op, src.numel())
    is_mla = len(src_ptrs) == 1
    src_pages = torch.div(src[::page_size], page_size, rounding_mode="floor")
    # Consecutive source pages landing on consecutive destination pages merge into one copy.
    for s, d, k in _runs(src_pages, dst[::page_size], 1, page_size):
        for j in range(num_layers):
            for part in range(1 if is_mla else 2):
                pages = src_ptrs[part][s : s + k].select(1, layer_id + j)[:, :page_size]
                rows = dst_ptrs[j + part * num_layers][d : d + k * page_size]
                _copy_rows(pages, _split_rows(rows, k, page_size))


def transfer_kv_all_layer_direct_lf_pf(
    src_ptrs: List[Tensor],
    dst_ptrs: List[Tensor],
    src_indices: Tensor,
    dst_indices: Tensor,
    page_size: int,
) -> None:
    """lf -> page_first_direct for all layers. ``src_ptrs`` is ``[layer_0..]`` (MLA) or
    ``[k_0.., v_0..]``; ``dst_ptrs`` is ``[kv]`` or ``[k, v]``, each
    ``[page, layer, page_size, ...]``.
    Per page ``i``: ``dst[dst_indices[i*ps] // ps][j][:page_size] = src[j][s : s + page_size]``
    with ``s = src_indices[i*ps]``."""
    op = "transfer_kv_all_layer_direct_lf_pf"
    src, dst = _direct_indices(op, src_indices, dst_indices, page_size)
    num_layers = _check_page_first_direct(op, dst_ptrs, src_ptrs, src_indices, page_size)
    require_side_stream(op, src.numel())
    is_mla = len(dst_ptrs) == 1
    dst_pages = torch.div(dst[::page_size], page_size, rounding_mode="floor")
    for s, d, k in _runs(src[::page_size], dst_pages, page_size, 1):
        for j in range(num_layers):
            for part in range(1 if is_mla else 2):
                rows = src_ptrs[j + part * num_layers][s : s + k * page_size]
                pages = dst_ptrs[part][d : d + k].select(1, j)[:, :page_size]
                _copy_rows(_split_rows(rows, k, page_size), pages)


def require_side_stream(op: str, num_indices: int) -> None:
    """Refuse a non-empty page-first direct copy issued on the legacy default stream.

    The C++ issues one ``cudaMemcpyBatchAsync`` on ``getCurrentCUDAStream()``, and the
    driver rejects the legacy default stream outright ("cudaMemcpyBatchAsync failed.
    failIdx=... error=invalid argument", seen on an H200 with CUDA 13). SGLang's cache
    controller issues these copies on its write/load streams; a caller on the default
    stream works on CPU and fails on the GPU, so the CPU runtime refuses it too. Empty
    copies never reach the batch call."""
    if num_indices and CPU_DEVICE_MODULE.current_stream() is CPU_DEVICE_MODULE.default_stream:
        raise RuntimeError(
            f"{op}: cudaMemcpyBatchAsync rejects the legacy default stream (CUDA: invalid "
            "argument); issue it on a side stream, as the cache controller's write/load streams do"
        )


def _check_page_first_direct(
    op: str, pf_ptrs: List[Tensor], lf_ptrs: List[Tensor], indices: Tensor, page_size: int
) -> int:
    """Refuse buffers the real batch copy would misaddress; return the layer count.

    On CUDA >= 12.8 the C++ copies, per page and layer, ``page_size * lf_ptrs[0].stride(0) *
    element_size`` raw bytes between ``lf_ptrs[j].data_ptr() + row * stride0`` and
    ``pf_ptrs[p].data_ptr() + page * pf_ptrs[0].stride(0) + layer * pf_ptrs[0].stride(1)``.
    That equals the shape-checked ``copy_`` done here only if: one element size throughout;
    every lf buffer is contiguous with ``lf_ptrs[0]``'s row stride (a strided layer view
    would spill into its neighbour); every pf buffer has ``pf_ptrs[0]``'s page and layer
    strides; and one layer of one page is a contiguous block of ``page_size`` lf rows.
    """
    if indices.dim() != 1:  # the C++ takes size(0) / page_size pages
        raise ValueError(f"{op}: indices must be 1-D, got shape {tuple(indices.shape)}")
    if len(pf_ptrs) not in (1, 2):
        raise ValueError(f"{op}: expected [kv] or [k, v] page-first buffers, got {len(pf_ptrs)}")
    if len(lf_ptrs) % len(pf_ptrs):
        raise ValueError(f"{op}: {len(lf_ptrs)} layer buffers do not split into k and v")
    element_size = pf_ptrs[0].element_size()
    if any(t.element_size() != element_size for t in [*pf_ptrs, *lf_ptrs]):
        raise ValueError(f"{op}: buffers differ in element size; the batch copy uses one")
    row_stride = lf_ptrs[0].stride(0)
    for j, t in enumerate(lf_ptrs):
        if not t.is_contiguous() or t.stride(0) != row_stride or t[0].numel() != row_stride:
            raise ValueError(
                f"{op}: layer buffer {j} (shape {tuple(t.shape)}, strides {t.stride()}) is not "
                f"contiguous rows of stride {row_stride}, which the batch copy assumes"
            )
    for p, t in enumerate(pf_ptrs):
        if t.stride()[:2] != pf_ptrs[0].stride()[:2]:
            raise ValueError(f"{op}: page-first buffer {p} strides {t.stride()} differ from 0's")
        block = t[0, 0, :page_size]
        if block.shape[0] != page_size or not block.is_contiguous():
            raise ValueError(
                f"{op}: page-first buffer {p} does not hold contiguous pages of {page_size} rows"
            )
        if block.numel() != page_size * row_stride:
            raise ValueError(
                f"{op}: a page of page-first buffer {p} holds {block.numel()} elements, the "
                f"batch copy moves {page_size * row_stride}"
            )
    return len(lf_ptrs) // len(pf_ptrs)


def _split_rows(rows: Tensor, num_pages: int, page_size: int) -> Tensor:
    """View ``num_pages * page_size`` rows as ``[num_pages, page_size, ...]``."""
    if rows.shape[0] != num_pages * page_size:
        raise IndexError(
            f"direct transfer: run of {num_pages * page_size} rows clipped to {rows.shape[0]}"
        )
    return rows.unflatten(0, (num_pages, page_size))


__all__ = [
    "is_hip",
    "transfer_kv_all_layer",
    "transfer_kv_all_layer_direct_lf_pf",
    "transfer_kv_all_layer_lf_pf",
    "transfer_kv_all_layer_lf_ph",
    "transfer_kv_all_layer_mla",
    "transfer_kv_all_layer_mla_lf_pf",
    "transfer_kv_direct",
    "transfer_kv_per_layer",
    "transfer_kv_per_layer_direct_pf_lf",
    "transfer_kv_per_layer_mla",
    "transfer_kv_per_layer_mla_pf_lf",
    "transfer_kv_per_layer_pf_lf",
    "transfer_kv_per_layer_ph_lf",
]
