"""Eviction room: lane-aware room on the device (an extend's and a load-back's exact draws
per owner lane, ``lane_eviction``) and on the host (a backup's, ``host_lane_eviction``),
one planner over a tier protocol for both (``lane_tier``): victims only on a short owner
lane. Exports its hook specs by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_DEVICE = "sglang_cp_hicache.v0_5_23.eviction.lane_eviction"
_HOST = "sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction"
_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"

HOOKS: Tuple[HookSpec, ...] = (
    # Device: the extend's exact draws first, then the load-back's (and any caller's)
    # evict_for_alloc, and upstream's extra plain-LRU floor loop skipped.
    HookSpec(
        "sglang.srt.mem_cache.allocation:alloc_paged_token_slots_extend",
        f"{_DEVICE}:alloc_paged_token_slots_extend_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.allocation:_kv_shard_rotation_bases",
        f"{_DEVICE}:kv_shard_rotation_bases_around",
        "AROUND",
    ),
    HookSpec(f"{_URC}.evict_for_alloc", f"{_DEVICE}:evict_for_alloc_around", "AROUND"),
    HookSpec(
        "sglang.srt.mem_cache.common:_evict_until_allocatable",
        f"{_DEVICE}:evict_until_allocatable_around",
        "AROUND",
    ),
    # A load-back's room and gate are its exact per-owner draws (the host slots' owners),
    # recorded and answered by a view of the cache its body runs over.
    HookSpec(f"{_URC}._load_back_transfers", f"{_DEVICE}:load_back_transfers_around", "AROUND"),
    # Host: given a backup's room (an explicit keyword: its host draws per owner lane),
    # victims only on a short lane. Upstream's backup hands it over through the backup
    # room's _execute_kv_backup hook (host_lane_eviction.backup_with_lane_room).
    HookSpec(f"{_URC}.evict_host", f"{_HOST}:evict_host_around", "AROUND"),
)
