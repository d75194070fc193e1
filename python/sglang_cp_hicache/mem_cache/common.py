"""Owner-lane aware eviction before allocation (extends ``sglang.srt.mem_cache.common``).

Upstream evicts a scalar token count before ``alloc_extend``. Under CP shared KV a new
page must come from its compute owner's lane, so the total can suffice while one lane is
empty; ``alloc_extend`` would then return None and SGLang raises "Prefill out of memory".
Evicting until each lane has the pages the batch needs makes that recoverable. The plan is
a pure function of replicated state (tree, lane free counts, lens): no collective.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch

from sglang_cp_hicache.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator


logger = logging.getLogger(__name__)
_warned_rebalance = False


def evict_for_owner_lanes(tree_cache: Any, lane_pages_needed: torch.Tensor) -> None:
    """Evict device cache (LRU, deterministic) until every lane has the pages needed."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    allocator: CPSharedPagedTokenToKVPoolAllocator = tree_cache.token_to_kv_pool_allocator
    tokens_per_lane_page = allocator.cp_size * allocator.page_size
    while True:
        deficit = (lane_pages_needed - allocator.lane_available_pages()).clamp(min=0)
        if not bool(deficit.any()):
            return
        # LRU leaves free pages of every lane roughly evenly; ask for enough logical
        # tokens to cover the worst lane's deficit on its own.
        want = int(deficit.max()) * tokens_per_lane_page
        if tree_cache.evict(EvictParams(num_tokens=want)).num_tokens_evicted == 0:
            return


def alloc_paged_token_slots_extend_around(
    original: Callable, tree_cache: Any, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
    *args, **kwargs,
):
    allocator = getattr(tree_cache, "token_to_kv_pool_allocator", None)
    if isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator) and not tree_cache.is_chunk_cache():
        lane_pages = allocator.extend_lane_pages(prefix_lens_cpu, seq_lens_cpu)
        evict_for_owner_lanes(tree_cache, lane_pages)
        lanes_short = bool((lane_pages > allocator.lane_available_pages()).any())
        if lanes_short and int(lane_pages.sum()) <= int(allocator.lane_available_pages().sum()):
            _warn_rebalance_once(lane_pages, allocator.lane_available_pages())
            allocator.place_next_extend_by_free_pages()
    return original(tree_cache, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, *args, **kwargs)


def _warn_rebalance_once(lane_pages: torch.Tensor, lane_free: torch.Tensor) -> None:
    global _warned_rebalance
    if not _warned_rebalance:
        _warned_rebalance = True
        logger.warning(
            "CP shared KV: compute-owner lanes stay short after eviction (need %s pages per "
            "lane, free %s, rest held by running requests); placing this batch's new pages "
            "on the freest lanes instead. Logged once; later batches do the same silently.",
            lane_pages.tolist(),
            lane_free.tolist(),
        )
