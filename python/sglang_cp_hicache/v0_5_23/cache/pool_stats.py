"""Device tokens in use under the flag, counted over every free page.

Upstream's ``SchedulerPoolStatsObserver._get_token_info`` counts ``used = capacity -
(available_size + evictable)``. A sharded allocator's ``available_size`` is its admission
floor (the tightest owner lane x N), so with lanes uneven it counts free pages of the
other lanes as in use: an idle sharded prefill reported 192 tokens in use (``/v1/loads``,
``sglang:num_used_tokens``) with nothing held after a soak. Upstream's own conservation
check counts ``aggregate_free_size`` (every free page) instead; the reported use follows
it, so it is what requests and locks hold, as on an unsharded server. The admission floor
(``full_available_size``) is reported as upstream computes it: admission uses it.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of


def token_info_after(result: Any, observer: Any) -> Optional[Any]:
    """AFTER ``SchedulerPoolStatsObserver._get_token_info``: on a cache with an extension,
    the same stats with ``full_num_used`` and ``full_token_usage`` over every free page;
    None (upstream's stats unchanged) otherwise."""
    if extension_of(observer.tree_cache) is None:
        return None
    free = observer.token_to_kv_pool_allocator.aggregate_free_size()
    capacity = observer.max_total_num_tokens
    num_used = capacity - (free + result.full_evictable_size)
    return dataclasses.replace(result, full_num_used=num_used, full_token_usage=num_used / capacity)


__all__ = ["token_info_after"]
