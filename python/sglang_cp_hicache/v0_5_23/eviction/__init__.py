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
_TREE_CORE = "sglang.srt.mem_cache.unified_cache.unified_tree_core:UnifiedTreeCore"
_FULL = "sglang.srt.mem_cache.unified_cache.components.full:FullComponent"

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
    # A plan's victims are evicted by upstream's own device walk, which takes its nodes
    # from the plan (and builds no heap of every leaf) while one is being evicted.
    HookSpec(
        f"{_FULL}._evict_device_start", f"{_DEVICE}:full_evict_device_start_around", "AROUND"
    ),
    HookSpec(
        f"{_FULL}._evict_device_next_node",
        f"{_DEVICE}:full_evict_device_next_node_around",
        "AROUND",
    ),
    HookSpec(
        "sglang.srt.mem_cache.common:_evict_until_allocatable",
        f"{_DEVICE}:evict_until_allocatable_around",
        "AROUND",
    ),
    # A load-back's room and gate are its exact per-owner draws (the host slots' owners).
    HookSpec(f"{_URC}._load_back_transfers", f"{_DEVICE}:load_back_transfers_around", "AROUND"),
    HookSpec(
        f"{_TREE_CORE}.build_load_back_spec", f"{_DEVICE}:build_load_back_spec_around", "AROUND"
    ),
    HookSpec(
        f"{_URC}._component_available_size",
        f"{_DEVICE}:component_available_size_around",
        "AROUND",
    ),
    # Host: the backup's exact host draws per owner lane, victims only on a short lane.
    HookSpec(
        f"{_URC}._execute_and_commit_kv_backup",
        f"{_HOST}:execute_and_commit_kv_backup_around",
        "AROUND",
    ),
    HookSpec(f"{_TREE_CORE}.build_backup_spec", f"{_HOST}:build_backup_spec_around", "AROUND"),
    HookSpec(f"{_URC}.evict_host", f"{_HOST}:evict_host_around", "AROUND"),
)
