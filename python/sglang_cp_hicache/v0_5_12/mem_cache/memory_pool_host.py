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

With an MTP draft, :class:`CpHostPoolGroup` is the one host object of target and draft:
the draft's MLA KV + indexer host pools over the same physical slots as the target's,
sized with it from one per-rank budget (:func:`split_host_budget`), moved by every
all-layer backup, load, free and clear of the group.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Optional, Union

import torch

from sglang.srt.mem_cache import memory_pool_host as _host

from sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup import per_layer_backup_problem


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


# ------------------------------------------------------------------ target + draft
class DraftHostSlotsError(RuntimeError):
    """The draft host pools could not follow the target's: no slots, or other slots."""


def nsa_host_stack_bytes(device_pool: Any, pages: int, page_size: int) -> int:
    """Bytes SGLang allocates for the host stack of the NSA ``device_pool`` (an
    ``MLATokenToKVPoolHost`` with the pool's ``kv_cache_dim`` plus its
    ``NSAIndexerPoolHost``) at ``pages`` host pages, in every supported layout: the MLA
    buffer holds ``size x layer_num x kv_cache_dim`` elements, the indexer buffer
    ``(size + page_size + 1) // page_size`` pages of every layer (SGLang's sizing)."""
    size = pages * page_size
    kv_bytes = size * device_pool.kv_cache_dim * device_pool.store_dtype.itemsize * device_pool.layer_num
    index_per_token = device_pool.index_head_dim + device_pool.index_head_dim // device_pool.quant_block_size * 4
    index_page_bytes = (
        index_per_token * page_size * _host.NSATokenToKVPool.index_k_with_scale_buffer_dtype.itemsize
    )
    index_pages = (size + page_size + 1) // page_size
    return kv_bytes + index_pages * device_pool.layer_num * index_page_bytes


def sglang_host_pages(device_pool: Any, page_size: int, hicache_ratio: float, hicache_size: int) -> int:
    """The host pages SGLang's ``HostKVCache`` gives the MLA pool of ``device_pool`` at
    ``--hicache-ratio`` / ``--hicache-size`` (GB, sized by the MLA bytes per token only),
    including its extra page."""
    if hicache_size > 0:
        kv_bytes_per_token = device_pool.kv_cache_dim * device_pool.store_dtype.itemsize * device_pool.layer_num
        size = int(hicache_size * 1e9 // kv_bytes_per_token)
    else:
        size = int(device_pool.size * hicache_ratio)
    return size // page_size + 1


@dataclass(frozen=True)
class HostBudgetSplit:
    """One per-rank host budget shared by the target's and the draft's host pools.

    ``budget_bytes`` is what SGLang allocates for the target alone at the same flags
    (``target_pages_alone`` pages of MLA KV + indexer). With the draft, both pools get the
    same ``pages`` (one page table, the same physical slots), the most for which
    ``target_bytes + draft_bytes <= budget_bytes``.
    """

    budget_bytes: int
    target_pages_alone: int
    pages: int
    page_size: int
    target_bytes: int
    draft_bytes: int

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size


def split_host_budget(
    target_pool: Any, draft_pool: Any, page_size: int, hicache_ratio: float, hicache_size: int
) -> HostBudgetSplit:
    """The host pages the target and its draft both get from the target's budget."""
    alone = sglang_host_pages(target_pool, page_size, hicache_ratio, hicache_size)
    budget = nsa_host_stack_bytes(target_pool, alone, page_size)

    def both(pages: int) -> int:
        return nsa_host_stack_bytes(target_pool, pages, page_size) + nsa_host_stack_bytes(
            draft_pool, pages, page_size
        )

    per_page = both(1) - both(0)
    pages = budget // per_page  # an upper bound: both(p) = per_page * p + fixed
    while pages > 0 and both(pages) > budget:
        pages -= 1
    return HostBudgetSplit(
        budget_bytes=budget,
        target_pages_alone=alone,
        pages=pages,
        page_size=page_size,
        target_bytes=nsa_host_stack_bytes(target_pool, pages, page_size),
        draft_bytes=nsa_host_stack_bytes(draft_pool, pages, page_size),
    )


def hicache_ratio_for_pages(device_pool: Any, pages: int, page_size: int) -> float:
    """A ``--hicache-ratio`` (with ``--hicache-size 0``) for which SGLang's ``HostKVCache``
    over ``device_pool`` gets exactly ``pages`` pages: it takes ``int(size x ratio) //
    page_size + 1`` pages, so aim half a page (and half a token) inside the last one."""
    return ((pages - 1) * page_size + page_size // 2 + 0.5) / device_pool.size


def build_nsa_host_group(device_pool: Any, pages: int, page_size: int, layout: str) -> Any:
    """``HostPoolGroup`` [MLA KV anchor, NSA indexer] over ``device_pool`` with ``pages``
    host pages, built as SGLang's assembler builds the target's."""
    from sglang.srt.mem_cache.hicache_storage import PoolName
    from sglang.srt.mem_cache.hybrid_cache.hybrid_pool_assembler import build_pool_entry

    kv_host = _host.MLATokenToKVPoolHost(
        device_pool,
        hicache_ratio_for_pages(device_pool, pages, page_size),
        0,
        page_size,
        layout,
        override_kv_cache_dim=device_pool.kv_cache_dim,
    )
    if kv_host.size != pages * page_size:
        raise DraftHostSlotsError(
            f"host pool of {kv_host.size} slots, expected {pages} pages of {page_size}"
        )
    index_host = _host.NSAIndexerPoolHost(device_pool, kv_host, layout)
    layers = {layer: layer for layer in range(device_pool.layer_num)}
    entries = [
        build_pool_entry(
            name=name,
            host_pool=host_pool,
            device_pool=device_pool,
            layer_mapping=layers,
            transfer_layer_num=device_pool.layer_num,
            is_anchor=name == PoolName.KV,
        )
        for name, host_pool in ((PoolName.KV, kv_host), (PoolName.INDEXER, index_host))
    ]
    return _host.HostPoolGroup(entries)


def host_group_bytes(group: Any) -> int:
    """Bytes of every host buffer of ``group`` (MLA KV and indexer)."""
    total = 0
    for entry in group.entries:
        pool = entry.host_pool
        buffer = pool.index_k_with_scale_buffer if isinstance(pool, _host.NSAIndexerPoolHost) else pool.kv_buffer
        total += buffer.numel() * buffer.element_size()
    return total


class CpHostPoolGroup(_host.HostPoolGroup):
    """The CP HiCache host object: the target's ``HostPoolGroup`` (MLA KV anchor + NSA
    indexer) and, with an MTP draft, the draft's, over the same physical host slots.

    One slot index names the same token in every pool, so one page table (the
    controller's ``CpHostPageTable``) and one ack serve both. Every operation the
    controller and SGLang's transfer code run on the group moves both: ``alloc`` / ``free``
    / ``clear`` keep the draft's free list identical to the target's (an allocation the
    draft cannot follow is undone on the target and raises :class:`DraftHostSlotsError`);
    the all-layer backup copies the draft's layer after the target's; the per-layer load
    copies it with the target's last layer, before that layer's completion event, so the
    draft forward (which runs after every target layer waited for its load) reads loaded
    bytes. The per-layer backup of the draft runs from the draft forward's own layer hook
    (the controller's draft stage), not here.
    """

    def __init__(self, target: Any, draft: Optional[Any] = None) -> None:
        super().__init__(target.entries)
        self.draft = draft
        self._last_target_layer = self.anchor_entry.host_pool.layer_num - 1
        if draft is not None and (
            draft.size != self.size or draft.page_size != self.page_size or draft.layout != self.layout
        ):
            raise DraftHostSlotsError(
                f"draft host pools ({draft.size} slots, page {draft.page_size}, {draft.layout}) "
                f"do not mirror the target's ({self.size} slots, page {self.page_size}, {self.layout})"
            )

    @property
    def draft_device_pool(self) -> Any:
        return self.draft.anchor_entry.device_pool

    def draft_transfers(self, host_indices, device_indices) -> List[Any]:
        """The draft indexer's transfer at the KV indices (as the target's indexer)."""
        from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer

        return [PoolTransfer(name=PoolName.INDEXER, host_indices=host_indices, device_indices=device_indices)]

    def clear(self) -> None:
        super().clear()
        if self.draft is not None:
            self.draft.clear()

    def alloc(self, need_size: int) -> Optional[torch.Tensor]:
        locs = super().alloc(need_size)
        if locs is None or self.draft is None:
            return locs
        draft_locs = self.draft.alloc(need_size)
        if draft_locs is not None and torch.equal(draft_locs, locs):
            return locs
        super().free(locs)
        if draft_locs is None:
            raise DraftHostSlotsError(
                f"the draft host pool refused {need_size} slots the target's pool gave "
                f"({self.draft.available_size()} draft slots free); the target's were released"
            )
        self.draft.free(draft_locs)
        raise DraftHostSlotsError(
            f"the draft host pool gave other slots than the target's for {need_size} tokens "
            f"(first {draft_locs[:2].tolist()} vs {locs[:2].tolist()}); both were released"
        )

    def free(self, indices: torch.Tensor) -> int:
        freed = super().free(indices)
        if self.draft is not None:
            self.draft.free(indices)
        return freed

    def backup_from_device_all_layer(
        self, device_pool, host_indices, device_indices, io_backend, pool_transfers: Optional[list] = None
    ) -> None:
        super().backup_from_device_all_layer(
            device_pool, host_indices, device_indices, io_backend, pool_transfers=pool_transfers
        )
        if self.draft is not None and host_indices.numel() > 0:
            self.draft.backup_from_device_all_layer(
                self.draft_device_pool,
                host_indices,
                device_indices,
                io_backend,
                pool_transfers=self.draft_transfers(host_indices, device_indices),
            )

    def load_to_device_per_layer(
        self, device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers: Optional[list] = None
    ) -> None:
        super().load_to_device_per_layer(
            device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers=pool_transfers
        )
        if self.draft is not None and layer_id == self._last_target_layer and host_indices.numel() > 0:
            for draft_layer in range(self.draft_device_pool.layer_num):
                self.draft.load_to_device_per_layer(
                    self.draft_device_pool,
                    host_indices,
                    device_indices,
                    draft_layer,
                    io_backend,
                    pool_transfers=self.draft_transfers(host_indices, device_indices),
                )
