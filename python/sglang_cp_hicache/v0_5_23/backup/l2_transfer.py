"""One layer of a D2H backup at a time, over SGLang 0.5.23's L2 transfer path.

Upstream copies every layer of a backup in one submission
(``L2TransferEngine.submit_device_to_host`` -> ``backup_from_device_all_layer_physical``)
after a fence on the forward stream. :class:`L2LayerTransfers` is the 0.5.23 mechanism of
``core.per_layer_backup``: it resolves a forward's held writes into upstream's own
``L2Transfer`` list once (the controller's owner filter, ``_move_write_operation``, and the
engine's index preparation), then copies one layer of each with the host pools' own
one-layer D2H ops (``MLATokenToKVPoolHost._backup_from_device_per_layer``, the DSA
indexer's ``DSAIndexerPoolHost._backup_from_device_per_layer``), and appends upstream's
``HiCacheAck`` to the controller's ``ack_write_queue``, where ``writing_check``'s MIN
all-reduce counts it like any other write.

Into a ``page_first`` host pool upstream's MLA op runs the JIT one-layer kernel over the
host layer's strided view; the DSA indexer's op refuses ``page_first``
(``pool_host/dsa.py:481-485``), so :func:`indexer_layer_into_page_first` makes the same
kernel call over the indexer's per-layer view (pages as items). The layout is read once, at
construction (design: ``docs/per_layer_page_first.md``).

:class:`DeviceBackupStreams` gives the pipeline the device module's events and the
engine's D2H stream. Nothing here runs a collective.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Sequence

import torch

from sglang_cp_hicache.core.per_layer_backup import BackupEvent


@dataclass
class ReservedWrite:
    """Host slots reserved before a forward for one leaf's logical device slots.

    ``node_id`` is the ack id (the reservation's ticket, < -1); ``host_indices`` and
    ``device_indices`` are logical (the tree's), ``pool_transfers`` the side pools'
    (the DSA indexer) as ``allocate_host_transfers`` resolved them.
    """

    node_id: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    pool_transfers: Optional[list] = None


@dataclass
class MergedTransfer:
    """This rank's owned rows of one forward's held writes, as upstream's prepared
    ``L2Transfer`` list (anchor KV first, then the indexer). Never empty."""

    transfers: List[Any]


def _native(host_pool: Any) -> Any:
    """The SGLang host pool behind ``host_pool`` (``PageInterleaveHostPool`` wraps one)."""
    return getattr(host_pool, "host_pool", host_pool)


def per_layer_problem(controller: Any) -> Optional[str]:
    """Why ``controller``'s host pools cannot back up one layer at a time; None when they
    can. Read once at attach: layer_first with kernel or direct I/O (upstream's one-layer
    D2H ops), page_first with kernel I/O where the JIT one-layer kernel serves the latent
    rows (upstream's ``can_use_jit``) and the indexer pages."""
    from sglang.srt.mem_cache.pool_host.base import shared_host_layout_domains
    from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

    group = controller.mem_pool_host
    io_backend = controller.io_backend
    pools = [_native(entry.host_pool) for entry in group.entry_map.values()]
    if list(shared_host_layout_domains([entry.host_pool for entry in group.entry_map.values()])):
        return "host pools with a shared compacting layout domain"
    if io_backend not in ("kernel", "direct"):
        return f"io backend {io_backend!r}"
    anchor = _native(group.anchor_entry.host_pool)
    layout = anchor.layout
    if any(pool.layout != layout for pool in pools):
        return f"host pools of different layouts {sorted({pool.layout for pool in pools})}"
    if getattr(anchor, "dcp_size", 1) > 1:
        return "decode context parallel host pools (dcp_size > 1)"
    if layout == "layer_first":
        return None
    if layout != "page_first":
        return f"host layout {layout!r}: SGLang 0.5.23 has no one-layer D2H op into it (use page_first or layer_first)"
    if io_backend != "kernel":
        return f"host layout 'page_first' with io backend {io_backend!r}: SGLang 0.5.23 has no one-layer direct D2H op into it"
    if not anchor.can_use_jit:
        row = anchor.kv_cache_dim * anchor.dtype.itemsize
        return (
            f"host layout 'page_first' without the JIT one-layer kernel for {row}-byte latent rows "
            "(needs SGLANG_HICACHE_TMA_TRANSFER on an sm_90+ part, or --hicache-mem-layout layer_first)"
        )
    from sglang.kernels.ops.kvcache.hicache import can_use_hicache_jit_kernel

    for pool in pools:
        if isinstance(pool, DSAIndexerPoolHost) and not can_use_hicache_jit_kernel(
            element_size=pool.indexer_page_stride_size, page_size=1
        ):
            return (
                f"host layout 'page_first' without the JIT one-layer kernel for the DSA indexer's "
                f"{pool.indexer_page_stride_size}-byte pages (use --hicache-mem-layout layer_first)"
            )
    return None


def indexer_layer_into_page_first(
    host_pool: Any, device_pool: Any, host_indices: torch.Tensor, device_indices: torch.Tensor,
    controller_layer: int, is_draft: bool,
) -> None:  # fmt: skip
    """One layer of the DSA indexer's K/scale pages into its ``page_first`` host pool.

    The host layer ``h`` of a ``[pages, layers, 1, B]`` buffer, seen as ``[pages, B]`` with
    stride ``layers * B``, is the JIT one-layer kernel's operand as is (the MLA latent's
    ``data_refs`` view); pages are the items (``page_size=1``). Layers and pages as upstream's
    own ``_backup_from_device_per_layer`` resolves them; a draft's device pool holds one layer."""
    from sglang.kernels.ops.kvcache.hicache import transfer_hicache_one_layer_mla

    if is_draft:
        host_layer, device_layer = host_pool._draft_host_layer(controller_layer), 0
    else:
        host_layer, device_layer = host_pool._host_layer_index(controller_layer), controller_layer
    host_pages, device_pages = host_pool._get_indexer_page_indices(host_indices, device_indices)
    transfer_hicache_one_layer_mla(
        cache_dst=host_pool.index_k_with_scale_buffer.transpose(0, 1)[host_layer],
        indices_dst=host_pages,
        cache_src=device_pool.index_k_with_scale_buffer[device_layer],
        indices_src=device_pages,
        element_dim=host_pool.indexer_page_stride_size,
        page_size=1,
    )


class L2LayerTransfers:
    """``core.per_layer_backup.LayerTransfers`` over one ``HybridCacheController``."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller
        self._engine = controller.l2_transfer_engine
        # One layout for every host pool (per_layer_problem checked it at attach).
        self._page_first = _native(controller.mem_pool_host.anchor_entry.host_pool).layout == "page_first"

    def merge(self, writes: Sequence[ReservedWrite]) -> Optional[MergedTransfer]:
        from sglang.srt.managers.cache_controller import CacheOperation

        cc = self._controller
        ops = [
            CacheOperation(w.host_indices, w.device_indices, w.node_id, None, pool_transfers=w.pool_transfers)
            for w in writes
        ]
        op = CacheOperation.merge_ops(ops) if len(ops) > 1 else ops[0]
        host, device, pool_transfers = cc._move_write_operation(op)
        transfers = cc._l2_transfers(host, device, pool_transfers)
        if not transfers:  # a rank that owns none of the pages still acks (empty copies)
            return None
        return MergedTransfer(self._engine._prepare_transfers(transfers))

    def copy_layer(self, merged: MergedTransfer, layer_id: int) -> None:
        for transfer in merged.transfers:
            self._copy(transfer, layer_id, draft=False)

    def copy_draft_layer(self, merged: MergedTransfer, layer_id: int) -> None:
        for transfer in merged.transfers:
            self._copy(transfer, layer_id, draft=True)

    def _copy(self, transfer: Any, layer_id: int, draft: bool) -> None:
        """One layer of ``transfer`` with the host pool's own one-layer D2H op (the indexer
        into page_first: :func:`indexer_layer_into_page_first`); a draft layer goes to the
        host's tail layer ``target layers + layer_id`` (PACKED mode).

        A target layer goes through the pool entry's ``layer_mapper`` (transfer layer ->
        device layer), as upstream's per-layer loads do; None means the pool holds no
        buffer for the layer (a shared top-k layer's DSA indexer: no host layer), so
        nothing is copied for it."""
        from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

        if not draft and transfer.layer_mapper is not None:
            layer_id = transfer.layer_mapper(layer_id)
            if layer_id is None:
                return
        native = _native(transfer.host_pool)
        io_backend = self._engine.io_backend
        if isinstance(native, DSAIndexerPoolHost):
            if draft:
                device_pool = native.mtp_draft_device_pools[layer_id]
                controller_layer = native.device_pool.layer_num + layer_id
            else:
                device_pool, controller_layer = transfer.device_pool, layer_id
            if self._page_first:
                indexer_layer_into_page_first(
                    native, device_pool, transfer.host_indices, transfer.device_indices, controller_layer, draft
                )
                return
            native._backup_from_device_per_layer(
                device_pool, transfer.host_indices, transfer.device_indices,
                controller_layer, io_backend, is_draft=draft,
            )  # fmt: skip
            return
        controller_layer = native._device_layer_num + layer_id if draft else layer_id
        native._backup_from_device_per_layer(
            transfer.host_indices, transfer.device_indices, controller_layer, io_backend,
            is_draft=draft,
        )  # fmt: skip

    def keep_alive(self, merged: MergedTransfer, stream: Any) -> None:
        self._engine._record_stream(merged.transfers, stream)

    def ack(self, start_event: BackupEvent, finish_event: BackupEvent, ack_ids: List[int]) -> None:
        """Upstream's write ack, after the batch's last layer: ``writing_check`` pops it
        (after its MIN all-reduce) and finishes every ack id in order."""
        from sglang.srt.managers.cache_controller import HiCacheAck

        cc = self._controller
        cc.mem_pool_device_allocator.set_hicache_transfer_done_event((id(cc), "write"), finish_event)
        cc.ack_write_queue.append(HiCacheAck(start_event=start_event, finish_event=finish_event, node_ids=list(ack_ids)))


class DeviceBackupStreams:
    """``core.per_layer_backup.BackupStreams``: 0.5.23's device module and the L2
    engine's D2H stream (the stream upstream's all-layer backups use)."""

    def __init__(self, controller: Any) -> None:
        from sglang.srt.mem_cache import l2_transfer

        self._device_module = l2_transfer.device_module
        self._stream = controller.l2_transfer_engine.device_to_host_stream

    def new_event(self) -> BackupEvent:
        return self._device_module.Event()

    @contextlib.contextmanager
    def on_write_stream(self) -> Iterator[Any]:
        with self._device_module.stream(self._stream):
            yield self._stream


__all__ = [
    "DeviceBackupStreams",
    "L2LayerTransfers",
    "MergedTransfer",
    "ReservedWrite",
    "indexer_layer_into_page_first",
    "per_layer_problem",
]
