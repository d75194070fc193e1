"""Per-layer D2H backup for SGLang's NSA host pools (extends ``sglang.srt.mem_cache.memory_pool_host``).

SGLang's host pools load one layer at a time (H2D, ``load_to_device_per_layer``) but back
up only all layers at once (D2H, ``backup_from_device_all_layer``). The per-layer backup
here mirrors the per-layer load with source and destination swapped, for the pools the NSA
stack uses: the MLA KV pool, the NSA indexer pool (index K + scale, whole pages) and the
``HostPoolGroup`` that combines them.

Adapters, not subclasses: SGLang's pool assembler builds these pools inside
``HiRadixCache.__init__``, before the CP controller exists; the controller wraps the group
it reuses (:func:`layer_backup_for`), so SGLang's pools stay untouched and nothing depends
on a hook being applied before the assembler's import.

Transfer ops (all in ``sgl_kernel.kvcacheio`` of sglang-kernel 0.4.2.post2, called through
SGLang's module so the binding is the one SGLang uses):

====================  ==========================================================
io backend, layout    one layer D2H
====================  ==========================================================
kernel, layer_first   ``transfer_kv_per_layer_mla`` (direction-agnostic lf -> lf)
direct, layer_first   ``transfer_kv_direct`` over the one layer
direct, page_first_d  ``transfer_kv_all_layer_direct_lf_pf`` over a one-layer list into
                      the layer's slice of the page-first buffer (the op takes its layer
                      count from the list and addresses through the slice's pointer and
                      strides)
kernel, page_first    none: the kernel has no lf -> pf op for one layer. Refused at
                      startup (``cp_layer_backup.per_layer_backup_problem``, checked by
                      ``server_args.unsupported_cache_combinations``), not emulated.
====================  ==========================================================
"""

from __future__ import annotations

from typing import Any, List, Optional, Union

import torch

from sglang.srt.mem_cache import memory_pool_host as _host

from sglang_cp_hicache.mem_cache.cp_layer_backup import per_layer_backup_problem


class PerLayerBackupUnsupported(ValueError):
    """The host pool's io backend and layout have no per-layer D2H transfer."""


def _check_supported(io_backend: str, layout: str) -> None:
    problem = per_layer_backup_problem(io_backend, layout)
    if problem is not None:
        raise PerLayerBackupUnsupported(f"per-layer HiCache backup: {problem}")


def _layer_slice(page_first: torch.Tensor, layer_id: int) -> torch.Tensor:
    """``[page, 1, ...]`` view of one layer of a ``[page, layer, ...]`` buffer."""
    return page_first[:, layer_id : layer_id + 1]


class MLAHostLayerBackup:
    """One layer of MLA KV (``kv_cache_dim`` per token), device -> ``MLATokenToKVPoolHost``."""

    def __init__(self, host_pool: Any) -> None:
        self.host_pool = host_pool

    def backup_from_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id: int, io_backend: str
    ) -> None:
        host = self.host_pool
        _check_supported(io_backend, host.layout)
        if io_backend == "kernel":
            _host.transfer_kv_per_layer_mla(
                src=device_pool.kv_buffer[layer_id],
                dst=host.kv_buffer[layer_id],
                src_indices=device_indices,
                dst_indices=host_indices,
                item_size=host.token_stride_size,
            )
        elif host.layout == "layer_first":
            _host.transfer_kv_direct(
                src_layers=[device_pool.kv_buffer[layer_id]],
                dst_layers=[host.kv_buffer[layer_id]],
                src_indices=device_indices,
                dst_indices=host_indices,
                page_size=host.page_size,
            )
        else:  # page_first_direct
            _host.transfer_kv_all_layer_direct_lf_pf(
                src_ptrs=[device_pool.kv_buffer[layer_id]],
                dst_ptrs=[_layer_slice(host.kv_buffer, layer_id)],
                src_indices=device_indices,
                dst_indices=host_indices,
                page_size=host.page_size,
            )


class NSAIndexerHostLayerBackup:
    """One layer of NSA index K + scale (whole pages), device -> ``NSAIndexerPoolHost``.

    Token indices are page-aligned and turn into page indices exactly as SGLang's own
    indexer transfers do (``_get_indexer_page_indices``).
    """

    def __init__(self, host_pool: Any) -> None:
        self.host_pool = host_pool

    def backup_from_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id: int, io_backend: str
    ) -> None:
        host = self.host_pool
        _check_supported(io_backend, host.layout)
        host_pages, device_pages = host._get_indexer_page_indices(host_indices, device_indices)
        device_layer = device_pool.index_k_with_scale_buffer[layer_id]
        if io_backend == "kernel":
            if host.indexer_page_stride_size % 8:
                # SGLang's own indexer transfers refuse this too (no kernel, no fallback).
                raise PerLayerBackupUnsupported(
                    f"per-layer HiCache backup: indexer page stride {host.indexer_page_stride_size} "
                    "bytes is not a multiple of 8, which the kernel io backend needs"
                )
            _host.transfer_kv_per_layer_mla(
                src=device_layer,
                dst=host.index_k_with_scale_buffer[layer_id],
                src_indices=device_pages,
                dst_indices=host_pages,
                item_size=host.indexer_page_stride_size,
            )
        elif host.layout == "layer_first":
            _host.transfer_kv_direct(
                src_layers=[device_layer],
                dst_layers=[host.index_k_data_refs[layer_id]],
                src_indices=device_pages,
                dst_indices=host_pages,
                page_size=1,
            )
        else:  # page_first_direct
            _host.transfer_kv_all_layer_direct_lf_pf(
                src_ptrs=[device_layer],
                dst_ptrs=[_layer_slice(host.index_k_with_scale_buffer, layer_id)],
                src_indices=device_pages,
                dst_indices=host_pages,
                page_size=1,
            )


_PoolBackup = Union[MLAHostLayerBackup, NSAIndexerHostLayerBackup]


class HostPoolGroupLayerBackup:
    """One layer of every pool of a ``HostPoolGroup``: the anchor (KV) with the op's KV
    indices, then each extra pool transfer with its own indices, each entry at its
    ``layer_mapper`` layer (as the group's ``load_to_device_per_layer``)."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self.entry_backups = {entry.name: _pool_backup(entry.host_pool) for entry in group.entries}

    def backup_from_device_per_layer(
        self,
        device_pool,
        host_indices,
        device_indices,
        layer_id: int,
        io_backend: str,
        pool_transfers: Optional[List[Any]] = None,
    ) -> None:
        # ``device_pool`` is unused, as in SGLang's group: each entry has its own.
        anchor = self.group.anchor_entry
        local_layer_id = anchor.layer_mapper(layer_id)
        if local_layer_id is not None and host_indices.numel() > 0:
            self.entry_backups[anchor.name].backup_from_device_per_layer(
                anchor.device_pool, host_indices, device_indices, local_layer_id, io_backend
            )
        for transfer in pool_transfers or []:
            entry = self.group.entry_map.get(transfer.name)
            if entry is None or transfer.host_indices is None:
                continue
            local_layer_id = entry.layer_mapper(layer_id)
            if local_layer_id is None:
                continue
            self.entry_backups[entry.name].backup_from_device_per_layer(
                entry.device_pool,
                transfer.host_indices,
                transfer.device_indices,
                local_layer_id,
                io_backend,
            )


def _pool_backup(host_pool: Any) -> _PoolBackup:
    if isinstance(host_pool, _host.NSAIndexerPoolHost):
        return NSAIndexerHostLayerBackup(host_pool)
    if isinstance(host_pool, _host.MLATokenToKVPoolHost):
        return MLAHostLayerBackup(host_pool)
    raise TypeError(f"per-layer HiCache backup: no per-layer D2H for {type(host_pool).__name__}")


def layer_backup_for(host_pool: Any) -> Union[_PoolBackup, HostPoolGroupLayerBackup]:
    """The per-layer backup of ``host_pool`` (an MLA or indexer host pool, or their group)."""
    if isinstance(host_pool, _host.HostPoolGroup):
        return HostPoolGroupLayerBackup(host_pool)
    return _pool_backup(host_pool)
