"""Storage room: L3 under CP shared KV. The owner-free file and Mooncake backends
(``file_backend``, ``mooncake_backend``) chosen by the factory (``backend_factory``) at
startup and at runtime attach (``runtime_attach``); owner writes and owner reads of every
storage operation (``owner_io``); where an L3 prefetch is anchored and which owner its pages
start at (``prefetch_anchor``); the L3 tier's KV events, ``DISK`` / ``EXTERNAL``
(``l3_events``). Exports its hook specs by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_OWNER_IO = "sglang_cp_hicache.v0_5_23.storage.owner_io"
_ANCHOR = "sglang_cp_hicache.v0_5_23.storage.prefetch_anchor"
_EVENTS = "sglang_cp_hicache.v0_5_23.storage.l3_events"
_HCC = "sglang.srt.managers.cache_controller:HiCacheController"
_HYBRID = "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller:HybridCacheController"
_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"

HOOKS: Tuple[HookSpec, ...] = (
    # A sharded host pool gets the owner-free file / Mooncake backends; any other is refused.
    HookSpec(
        "sglang.srt.mem_cache.storage.backend_factory:StorageBackendFactory.create_backend",
        "sglang_cp_hicache.v0_5_23.storage.backend_factory:create_backend_around",
        "AROUND",
    ),
    # Every CP rank writes what it owns (the MLA writer rule within attention TP).
    HookSpec(
        f"{_HCC}._generate_storage_config", f"{_OWNER_IO}:generate_storage_config_around", "AROUND"
    ),
    # ...and its L3 series keep the rank's own tp_rank label, like its radix series.
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.storage_attachment:StorageAttachment._resolve_metrics_collector",
        f"{_OWNER_IO}:resolve_metrics_collector_around",
        "AROUND",
    ),
    # Backup: the owner writes its pages; a rank owning none does no I/O (still acked).
    HookSpec(f"{_HYBRID}._page_backup", f"{_OWNER_IO}:page_backup_around", "AROUND"),
    # Prefetch: each rank reads its owned pages; progress = its first missing owned page.
    HookSpec(
        f"{_HCC}._page_transfer_kv_batch", f"{_OWNER_IO}:page_transfer_kv_batch_around", "AROUND"
    ),
    # Prefetch host slots: cyclic from a start owner decided from replicated state.
    HookSpec(
        f"{_HYBRID}.alloc_prefetch_host_buffers",
        f"{_OWNER_IO}:alloc_prefetch_host_buffers_around",
        "AROUND",
    ),
    # A storage hit on a full host: lane-aware room for its slots' owner lanes.
    HookSpec(
        f"{_HYBRID}.allocate_storage_hit", f"{_OWNER_IO}:allocate_storage_hit_around", "AROUND"
    ),
    # Prefetch anchor: never under a pending backup; the pages' start owner recorded.
    HookSpec(f"{_URC}.prefetch_from_storage", f"{_ANCHOR}:prefetch_from_storage_around", "AROUND"),
    # Prefetch result: the fetched host nodes get the rotation base their host slots follow.
    HookSpec(
        f"{_URC}._handle_prefetch_result", f"{_ANCHOR}:handle_prefetch_result_around", "AROUND"
    ),
    # L3 KV events (DISK / EXTERNAL) on the publisher rank: held at the write, published
    # at its ack (upstream's MIN drain), retracted by a clear or a detach of the tier.
    HookSpec(f"{_URC}.write_backup_storage", f"{_EVENTS}:write_backup_storage_around", "AROUND"),
    HookSpec(
        f"{_URC}._drain_storage_control_queues_impl",
        f"{_EVENTS}:drain_storage_control_queues_impl_around",
        "AROUND",
    ),
    HookSpec(f"{_URC}.clear_storage_backend", f"{_EVENTS}:clear_storage_backend_around", "AROUND"),
    HookSpec(f"{_URC}.detach_storage_backend", f"{_EVENTS}:detach_storage_backend_around", "AROUND"),
    # Attached at runtime (admin API): file / mooncake as at startup, others refused.
    HookSpec(
        "sglang.srt.mem_cache.unified_cache.storage_attachment:StorageAttachment.attach",
        "sglang_cp_hicache.v0_5_23.storage.runtime_attach:attach_around",
        "AROUND",
    ),
)
