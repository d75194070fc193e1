"""Per-layer materialisation of a batch's prefix KV from the CP owners' shards.

For one layer, a rank builds a dense temporary buffer (MLA latent KV pages + NSA indexer
K/scale pages, laid out as :class:`CpSharedKVBatchMapping` says) holding every prefix page
the batch reads, using exactly one collective on the CP group. Two strategies sit behind
one interface (:class:`MaterializeStrategy`):

* ``all_reduce`` (:class:`DenseAllReduce`): each rank copies its owned pages into a
  zero-filled dense buffer, then SUM all-reduce. Exact for any dtype because every page
  has exactly one non-zero contributor (the buffer is reduced as integers).
* ``all_gather`` (:class:`OwnerPackedAllGather`): each rank packs its owned pages into a
  ``max_owned``-page slab, all-gather, then one contiguous copy per owner into its dense
  range. Moves about half the bytes of a ring all-reduce, plus the unpack copies.

KV and index pages share one flat byte allocation (KV block, then index block), so a layer
costs one collective. Both strategies are byte-exact copies; pages holding only current-
chunk tokens stay zero here and are filled by the caller from the gathered chunk.

:class:`LayerMaterializationPipeline` launches layer ``L + 1`` while layer ``L`` computes:
on CUDA on a side stream (which first waits for the compute stream, so prefix pages and
HiCache layer loads queued before are visible); on CPU through gloo's ``async_op``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional, Protocol

import torch
import torch.distributed as dist

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import CpSharedKVBatchMapping

# The strategy is chosen by cp_shared_kv_collectives (flag, bytes moved, backend).
PREFETCH_ENV = "SGLANG_CP_SHARED_KV_PREFETCH"

_BLOCK_ALIGN_BYTES = 256
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass(frozen=True)
class PagedLayerGeometry:
    """Byte geometry of one layer of an NSA pool (``NSATokenToKVPool`` or a twin of it)."""

    page_size: int
    kv_store_dtype: torch.dtype
    kv_token_shape: tuple  # trailing dims of ``kv_buffer[i]`` (``(1, kv_cache_dim)``)
    kv_page_bytes: int
    index_page_bytes: int

    @classmethod
    def of_pool(cls, pool) -> "PagedLayerGeometry":
        kv = pool.kv_buffer[0]
        index = pool.index_k_with_scale_buffer[0]
        token_bytes = kv[0].numel() * kv.element_size()
        return cls(
            page_size=pool.page_size,
            kv_store_dtype=kv.dtype,
            kv_token_shape=tuple(kv.shape[1:]),
            kv_page_bytes=pool.page_size * token_bytes,
            index_page_bytes=index.shape[1] * index.element_size(),
        )


class PoolPageReader:
    """Page-major byte views of a pool's layers, read through the pool's getters so
    HiCache layer-load waits apply to the stream that reads."""

    def __init__(self, pool):
        self.pool = pool
        self.geometry = PagedLayerGeometry.of_pool(pool)

    def kv_pages(self, layer_id: int) -> torch.Tensor:
        buf = self.pool.get_key_buffer(layer_id)
        return buf.view(torch.uint8).view(-1, self.geometry.kv_page_bytes)

    def index_pages(self, layer_id: int) -> torch.Tensor:
        buf = self.pool.get_index_k_with_scale_buffer(layer_id)
        return buf.view(torch.uint8).view(-1, self.geometry.index_page_bytes)


@dataclass
class DenseLayerKV:
    """One layer's dense buffers; drop-in replacements for the pool's layer buffers.

    ``kv_buffer``: ``[num_pages * page_size, *kv_token_shape]`` in the pool's store dtype;
    ``index_buffer``: ``[num_pages, index_page_bytes]`` uint8, 256-byte aligned. Both view
    ``flat``, so one collective moves both.
    """

    flat: torch.Tensor
    kv_pages: torch.Tensor
    index_pages: torch.Tensor
    kv_buffer: torch.Tensor
    index_buffer: torch.Tensor

    @classmethod
    def allocate(
        cls, geometry: PagedLayerGeometry, num_pages: int, device: torch.device, zero: bool = True
    ) -> "DenseLayerKV":
        kv_bytes = num_pages * geometry.kv_page_bytes
        # Kernels view the index block as fp32 and Triton assumes aligned pointers.
        index_offset = -(-kv_bytes // _BLOCK_ALIGN_BYTES) * _BLOCK_ALIGN_BYTES
        alloc = torch.zeros if zero else torch.empty
        flat = alloc(index_offset + num_pages * geometry.index_page_bytes, dtype=torch.uint8, device=device)
        kv_pages = flat[:kv_bytes].view(num_pages, geometry.kv_page_bytes)
        index_pages = flat[index_offset:].view(num_pages, geometry.index_page_bytes)
        kv_buffer = kv_pages.view(geometry.kv_store_dtype).view(-1, *geometry.kv_token_shape)
        return cls(flat, kv_pages, index_pages, kv_buffer, index_pages)

    def zero_outside(self, pages: slice) -> None:
        """Zero every page outside the contiguous range ``pages``."""
        for buf in (self.kv_pages, self.index_pages):
            buf[: pages.start].zero_()
            buf[pages.stop :].zero_()


def _gather_pages(source: torch.Tensor, pages: torch.Tensor, out: torch.Tensor) -> None:
    """``out[i] = source[pages[i]]`` without a temporary (``out`` is contiguous rows)."""
    torch.index_select(source, 0, pages, out=out)


def _collective_view(flat: torch.Tensor) -> torch.Tensor:
    """Reinterpret a byte buffer as int32 when possible (wider NCCL/gloo kernels)."""
    return flat.view(torch.int32) if flat.numel() % 4 == 0 else flat


def _all_gather_slabs(recv: torch.Tensor, send: torch.Tensor, group) -> dist.Work:
    """All-gather ``send`` from every rank into ``recv`` (rank-major), asynchronously.

    Gloo (the CPU twin and the one-GPU check) takes the list form, which it supports for
    both CPU and CUDA tensors; NCCL takes the single-tensor form.
    """
    if dist.get_backend(group) == "gloo":
        outputs = list(recv.view(dist.get_world_size(group), -1).unbind(0))
        return dist.all_gather(outputs, send, group=group, async_op=True)
    return _all_gather_single(_collective_view(recv), _collective_view(send), group=group, async_op=True)


@dataclass
class PendingDenseLayer:
    """A launched materialisation; :meth:`wait` orders the caller after it."""

    dense: DenseLayerKV
    work: Optional[dist.Work] = None
    finish: Optional[Callable[[], None]] = None
    keepalive: tuple = ()  # staging tensors besides ``dense`` (stream bookkeeping)

    def wait(self) -> DenseLayerKV:
        if self.work is not None:
            self.work.wait()
        if self.finish is not None:
            self.finish()
        return self.dense


class MaterializeStrategy(Protocol):
    name: str

    def launch(
        self, mapping: CpSharedKVBatchMapping, reader: PoolPageReader, layer_id: int
    ) -> PendingDenseLayer: ...


class DenseAllReduce:
    """Zero-filled dense buffer + owned pages, SUM all-reduce over the CP group."""

    name = "all_reduce"

    def __init__(self, group):
        self.group = group

    def launch(self, mapping, reader, layer_id):
        device = mapping.local_physical_pages.device
        dense = DenseLayerKV.allocate(reader.geometry, mapping.num_dense_pages, device)
        if mapping.plan.num_prefix_pages == 0:
            return PendingDenseLayer(dense)
        local = mapping.local_dense_range
        if local.stop > local.start:
            _gather_pages(reader.kv_pages(layer_id), mapping.local_physical_pages, dense.kv_pages[local])
            _gather_pages(reader.index_pages(layer_id), mapping.local_physical_pages, dense.index_pages[local])
        work = dist.all_reduce(_collective_view(dense.flat), group=self.group, async_op=True)
        return PendingDenseLayer(dense, work)


class OwnerPackedAllGather:
    """Each owner packs its pages into a ``max_owned``-page slab; all-gather; one
    contiguous copy per owner into its dense range."""

    name = "all_gather"

    def __init__(self, group):
        self.group = group

    def launch(self, mapping, reader, layer_id):
        geometry = reader.geometry
        device = mapping.local_physical_pages.device
        plan = mapping.plan
        slots = plan.max_owned
        if slots == 0:
            return PendingDenseLayer(DenseLayerKV.allocate(geometry, mapping.num_dense_pages, device))
        # The prefix range is fully overwritten below; zero only the rest.
        dense = DenseLayerKV.allocate(geometry, mapping.num_dense_pages, device, zero=False)
        dense.zero_outside(plan.prefix_dense_range)
        kv_slab_bytes = slots * geometry.kv_page_bytes
        slab_bytes = kv_slab_bytes + slots * geometry.index_page_bytes
        send = torch.empty(slab_bytes, dtype=torch.uint8, device=device)  # pad slots never read
        num_local = mapping.local_physical_pages.numel()
        if num_local > 0:
            _gather_pages(reader.kv_pages(layer_id), mapping.local_physical_pages, send[:kv_slab_bytes].view(slots, -1)[:num_local])
            _gather_pages(reader.index_pages(layer_id), mapping.local_physical_pages, send[kv_slab_bytes:].view(slots, -1)[:num_local])
        cp_size = mapping.layout.cp_size
        recv = torch.empty(cp_size * slab_bytes, dtype=torch.uint8, device=device)
        work = _all_gather_slabs(recv, send, self.group)

        def unpack() -> None:
            slabs = recv.view(cp_size, slab_bytes)
            kv_slabs = slabs[:, :kv_slab_bytes].view(cp_size, slots, -1)
            index_slabs = slabs[:, kv_slab_bytes:].view(cp_size, slots, -1)
            for owner in range(cp_size):
                pages = plan.dense_range(owner)
                count = pages.stop - pages.start
                dense.kv_pages[pages].copy_(kv_slabs[owner, :count])
                dense.index_pages[pages].copy_(index_slabs[owner, :count])

        return PendingDenseLayer(dense, work, unpack, keepalive=(send, recv))


STRATEGIES: Dict[str, Callable[[object], MaterializeStrategy]] = {
    DenseAllReduce.name: DenseAllReduce,
    OwnerPackedAllGather.name: OwnerPackedAllGather,
}


def make_strategy(name: str, group) -> MaterializeStrategy:
    if name not in STRATEGIES:
        raise ValueError(f"unknown CP shared-KV materialise strategy {name!r}; choose from {sorted(STRATEGIES)}")
    return STRATEGIES[name](group)


def prefetch_from_env() -> bool:
    return os.environ.get(PREFETCH_ENV, "1").lower() not in ("0", "false", "no", "off")


@dataclass
class LayerMaterializationPipeline:
    """Dense buffers of one forward, one layer at a time, next layer launched early.

    Invariant: every CP rank calls :meth:`get` with the same layer sequence, so every
    rank launches the same collectives in the same order.
    """

    strategy: MaterializeStrategy
    mapping: CpSharedKVBatchMapping
    reader: PoolPageReader
    end_layer: int
    prefetch: bool = True
    side_stream: Optional[torch.cuda.Stream] = None
    _pending: Dict[int, PendingDenseLayer] = field(default_factory=dict)
    _current_layer: Optional[int] = None
    _current: Optional[DenseLayerKV] = None

    def get(self, layer_id: int) -> DenseLayerKV:
        if layer_id == self._current_layer:
            return self._current
        pending = self._pending.pop(layer_id, None) or self._launch(layer_id)
        self._current_layer, self._current = layer_id, self._consume(pending)
        if self.prefetch and layer_id + 1 < self.end_layer and layer_id + 1 not in self._pending:
            self._pending[layer_id + 1] = self._launch(layer_id + 1)
        return self._current

    def close(self) -> None:
        """Complete any launched collective (peers launched it too) and drop buffers."""
        for pending in self._pending.values():
            if pending.work is not None:
                pending.work.wait()
        self._pending.clear()
        self._current_layer, self._current = None, None

    def _launch(self, layer_id: int) -> PendingDenseLayer:
        if self.side_stream is None:
            return self.strategy.launch(self.mapping, self.reader, layer_id)
        # Prefix pages were written by earlier work on the compute stream.
        self.side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side_stream):
            return self.strategy.launch(self.mapping, self.reader, layer_id)

    def _consume(self, pending: PendingDenseLayer) -> DenseLayerKV:
        if self.side_stream is not None:
            current = torch.cuda.current_stream()
            current.wait_stream(self.side_stream)
            # Allocated on the side stream, used on this one: keep the allocator honest.
            for tensor in (pending.dense.flat, *pending.keepalive):
                tensor.record_stream(current)
        return pending.wait()
