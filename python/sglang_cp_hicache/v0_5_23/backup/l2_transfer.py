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
all-reduce counts it like any other write. The ack carries what upstream's own all-layer
ack carries for ``_log_write_ack_metrics`` (the controller's own counts of the merged
operation: logical tokens per host pool, this rank's bytes; the span from layer 0's stores
to the last copy, timed when the cache exports metrics) and, as :class:`LayerBackupAck`,
the batch's timeline for the plugin's per-layer metrics.

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
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

from sglang.srt.managers.cache_controller import HiCacheAck

from sglang_cp_hicache.core.per_layer_backup import BackupEvent, BatchTimeline
from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of


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
    """One forward's held writes merged: this rank's owned rows as upstream's prepared
    ``L2Transfer`` list (anchor KV first, then the indexer; empty on a rank that owns none
    of the pages), and the controller's own counts of the merged operation, as upstream's
    all-layer ack carries them: logical tokens per host pool (equal on every rank) and the
    bytes this rank moves."""

    transfers: List[Any]
    num_tokens: int
    num_tokens_by_pool: Dict[str, int]
    num_bytes: int


class LayerBackupAck(HiCacheAck):
    """Upstream's write ack of one per-layer batch; ``timeline``: the batch's events, read
    by the plugin's metrics once the ack is popped (its finish synchronized)."""

    def __new__(cls, timeline: BatchTimeline, **fields: Any) -> "LayerBackupAck":
        ack = super().__new__(cls, **fields)
        ack.timeline = timeline
        return ack


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
            "(SGLang's can_use_hicache_jit_kernel refused it: a row size only its TMA kernel "
            "serves, which needs SGLANG_HICACHE_TMA_TRANSFER on an sm_90+ part, or a JIT build "
            "that failed on this host: nvcc, CUDA headers, ninja, see SGLang's warning above; "
            "or launch with --hicache-mem-layout layer_first)"
        )
    from sglang.kernels.ops.kvcache.hicache import can_use_hicache_jit_kernel

    for pool in pools:
        if isinstance(pool, DSAIndexerPoolHost) and not can_use_hicache_jit_kernel(
            element_size=pool.indexer_page_stride_size, page_size=1
        ):
            return (
                f"host layout 'page_first' without the JIT one-layer kernel for the DSA indexer's "
                f"{pool.indexer_page_stride_size}-byte pages (SGLang's can_use_hicache_jit_kernel refused "
                "it; see SGLang's warning above; or launch with --hicache-mem-layout layer_first)"
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
    """``core.per_layer_backup.LayerTransfers`` over one ``HybridCacheController``;
    ``timed``: its acks' events are timing events (:class:`DeviceBackupStreams`)."""

    def __init__(self, controller: Any, timed: bool = False) -> None:
        self._controller = controller
        self._timed = timed
        self._engine = controller.l2_transfer_engine
        # One layout for every host pool (per_layer_problem checked it at attach).
        self._page_first = _native(controller.mem_pool_host.anchor_entry.host_pool).layout == "page_first"

    def merge(self, writes: Sequence[ReservedWrite]) -> MergedTransfer:
        """Never None: a rank that owns none of the pages copies nothing (no transfers)
        and still acks the logical tokens."""
        from sglang.srt.managers.cache_controller import CacheOperation

        cc = self._controller
        ops = [
            CacheOperation(w.host_indices, w.device_indices, w.node_id, None, pool_transfers=w.pool_transfers)
            for w in writes
        ]
        op = CacheOperation.merge_ops(ops) if len(ops) > 1 else ops[0]
        host, device, pool_transfers = cc._move_write_operation(op)
        transfers = cc._l2_transfers(host, device, pool_transfers)
        return MergedTransfer(
            self._engine._prepare_transfers(transfers) if transfers else [],
            num_tokens=len(op.device_indices),
            num_tokens_by_pool=cc._num_tokens_by_pool(op),
            num_bytes=cc._transfer_num_bytes(op),
        )

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

    def ack(self, merged: MergedTransfer, ack_ids: List[int], timeline: BatchTimeline) -> None:
        """Upstream's write ack, after the batch's last layer: ``writing_check`` pops it
        (after its MIN all-reduce), finishes every ack id in order and counts it in
        upstream's backup metrics (``_log_write_ack_metrics``), as an all-layer ack."""
        cc = self._controller
        cc.mem_pool_device_allocator.set_hicache_transfer_done_event((id(cc), "write"), timeline.finished)
        cc.ack_write_queue.append(
            LayerBackupAck(
                timeline,
                start_event=timeline.first_stored,
                finish_event=timeline.finished,
                node_ids=list(ack_ids),
                num_tokens=merged.num_tokens,
                timing_enabled=self._timed,
                num_tokens_by_pool=dict(merged.num_tokens_by_pool),
                num_bytes=merged.num_bytes,
            )
        )


class DeviceBackupStreams:
    """``core.per_layer_backup.BackupStreams``: 0.5.23's device module and the L2
    engine's D2H stream (the stream upstream's all-layer backups use). ``timed``: every
    event is a timing event (decided once: the cache exports metrics and the device module
    times events, :func:`backup_events_timed`)."""

    def __init__(self, controller: Any, timed: bool = False) -> None:
        from sglang.srt.mem_cache import l2_transfer

        self._device_module = l2_transfer.device_module
        self._stream = controller.l2_transfer_engine.device_to_host_stream
        self._event_kwargs = {"enable_timing": True} if timed else {}

    def new_event(self) -> BackupEvent:
        return self._device_module.Event(**self._event_kwargs)

    @contextlib.contextmanager
    def on_write_stream(self) -> Iterator[Any]:
        with self._device_module.stream(self._stream):
            yield self._stream


def backup_events_timed(cache: Any) -> bool:
    """Whether a cache's per-layer backup times its events: it exports metrics (upstream's
    ``--enable-metrics`` collector) and the device module times events (upstream's own
    test, as for its all-layer transfers)."""
    from sglang.srt.mem_cache import l2_transfer

    return cache.metrics_collector is not None and l2_transfer._timing_events_supported()


def log_write_ack_metrics_after(result: Any, cache: Any, ack: Any) -> None:
    """AFTER ``UnifiedRadixCache._log_write_ack_metrics``: a timed per-layer batch's ack
    (popped: its events complete) feeds the plugin's per-layer latency series."""
    if isinstance(ack, LayerBackupAck) and ack.timing_enabled:
        extension = extension_of(cache)
        if extension is not None:
            extension.metrics.observe_layer_backup(ack.timeline)


__all__ = [
    "DeviceBackupStreams",
    "L2LayerTransfers",
    "LayerBackupAck",
    "MergedTransfer",
    "ReservedWrite",
    "backup_events_timed",
    "indexer_layer_into_page_first",
    "log_write_ack_metrics_after",
    "per_layer_problem",
]
