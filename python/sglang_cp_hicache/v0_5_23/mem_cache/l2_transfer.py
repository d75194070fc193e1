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


def per_layer_problem(controller: Any) -> Optional[str]:
    """Why ``controller``'s host pools cannot back up one layer at a time; None when they
    can. Read once at attach: upstream's one-layer D2H ops serve layer_first host pools
    (kernel and direct I/O)."""
    from sglang.srt.mem_cache.pool_host.base import shared_host_layout_domains

    group = controller.mem_pool_host
    io_backend = controller.io_backend
    pools = [entry.host_pool for entry in group.entry_map.values()]
    if list(shared_host_layout_domains(pools)):
        return "host pools with a shared compacting layout domain"
    if io_backend not in ("kernel", "direct"):
        return f"io backend {io_backend!r}"
    layout = group.anchor_entry.host_pool.layout
    if layout != "layer_first":  # DSAIndexerPoolHost has no one-layer D2H op into it
        return f"host layout {layout!r}: the DSA indexer host pool copies one layer only into layer_first"
    if getattr(group.anchor_entry.host_pool, "dcp_size", 1) > 1:
        return "decode context parallel host pools (dcp_size > 1)"
    return None


class L2LayerTransfers:
    """``core.per_layer_backup.LayerTransfers`` over one ``HybridCacheController``."""

    def __init__(self, controller: Any) -> None:
        self._controller = controller
        self._engine = controller.l2_transfer_engine

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
        """One layer of ``transfer`` with the host pool's own one-layer D2H op; a draft
        layer goes to the host's tail layer ``target layers + layer_id`` (PACKED mode)."""
        from sglang.srt.mem_cache.pool_host.dsa import DSAIndexerPoolHost

        host_pool = transfer.host_pool
        native = getattr(host_pool, "host_pool", host_pool)  # PageInterleaveHostPool wraps one
        io_backend = self._engine.io_backend
        if isinstance(native, DSAIndexerPoolHost):
            if draft:
                device_pool = native.mtp_draft_device_pools[layer_id]
                controller_layer = native.device_pool.layer_num + layer_id
            else:
                device_pool, controller_layer = transfer.device_pool, layer_id
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


__all__ = ["DeviceBackupStreams", "L2LayerTransfers", "MergedTransfer", "ReservedWrite", "per_layer_problem"]
