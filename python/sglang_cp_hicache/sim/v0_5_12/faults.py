"""Planted bugs (``SimConfig.fault``): each one must make a checker fail.

They patch this rank's process only (each rank is its own process), so nothing leaks
into other runs.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import numpy as np

from sglang_cp_hicache.sim.engine import FaultHooks, plant_match_prefix_barrier
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import RankStack

logger = logging.getLogger(__name__)


def apply_fault(
    name: Optional[str],
    stack: RankStack,
    rank: int,
    world_size: int,
    cp_group: Any,
    num_steps: int,
) -> FaultHooks:
    hooks = FaultHooks()
    if name is None:
        return hooks
    logger.warning("rank %d: planted fault %r is active", rank, name)
    last_rank = rank == world_size - 1
    if name == "roll_load_owners":
        _roll_load_owners()
    elif name == "drop_last_rank_loads" and last_rank:
        # The copies vanish but start_loading still acks: device pages keep their poison.
        stack.cache.cache_controller.mem_pool_host.load_to_device_per_layer = lambda *a, **k: None
    elif name == "hot_path_barrier":
        plant_match_prefix_barrier(stack.cache, cp_group)
    elif name == "diverge_last_rank" and last_rank:
        hooks.extra_eviction_at_step = num_steps // 2
    elif name == "leak_tail":
        _drop_partial_page_frees(stack)
    elif name == "shift_mirror":
        _shift_mirrored_extend_locs()
    elif name == "drop_last_rank_draft_loads" and last_rank:
        # Only the draft's copies vanish: the target's bytes load, the draft keeps its poison.
        stack.cache.cache_controller.mem_pool_host.draft.load_to_device_per_layer = lambda *a, **k: None
    return hooks


def _shift_mirrored_extend_locs() -> None:
    """The extend hook's host locs arrive one position late (the first one doubled)."""
    from sglang_cp_hicache.v0_5_12.mem_cache import common as mirror_hooks

    expand = mirror_hooks.extend_token_locs_host

    def shifted(*args, **kwargs):
        locs = expand(*args, **kwargs)
        return np.concatenate((locs[:1], locs[:-1]))

    mirror_hooks.extend_token_locs_host = shifted


def _drop_partial_page_frees(stack: RankStack) -> None:
    """cache_finished_req's free of the unaligned tail (less than a page) is lost.

    Every other free on this path is whole pages (duplicates) or goes through the
    controller's ``evict_device`` (evicted nodes, one loc per page), which passes.
    """
    allocator, controller = stack.allocator, stack.cache.cache_controller
    free, evict_device = allocator.free, controller.evict_device
    evicting = []

    def evict_device_passes(indices):
        evicting.append(True)
        try:
            return evict_device(indices)
        finally:
            evicting.pop()

    def free_whole_pages_only(indices):
        if not evicting and 0 < len(indices) < allocator.page_size:
            return None
        return free(indices)

    allocator.free = free_whole_pages_only
    controller.evict_device = evict_device_passes


def _roll_load_owners() -> None:
    """Load-back pages get the owner pattern shifted by one page.

    The layout validates owners only on host-resident tensors; on GPU the locs are device
    tensors and the guard is skipped, so the bug would corrupt KV silently. Turning the
    guard off here reproduces that on CPU.
    """
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

    original = CPSharedPagedTokenToKVPoolAllocator.take_logical_pages

    def take_rolled(self, page_owners, lane_pages):
        # Rolling keeps the per-lane counts, so lane_pages still matches.
        return original(self, np.roll(np.asarray(page_owners, dtype=np.int64), 1), lane_pages)

    CPSharedPagedTokenToKVPoolAllocator.take_logical_pages = take_rolled
    CpSharedKVLayout._raise_if_not_owned = lambda self, owners, unit: None
