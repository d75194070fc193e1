"""Upstream's host-tier gauges under the flag: ``sglang:hicache_host_used_tokens`` and
``sglang:hicache_host_total_tokens``, read logically from the sharded host pool.

Upstream's ``SchedulerMetricsReporter._log_hicache_stats`` publishes
``logical_size - available_size()``. A sharded host pool's ``available_size`` is an
admission floor (the tightest owner lane's free pages x the shard size), so with uneven
lanes it counts every lane as full as the fullest one, and its ``logical_size`` counts each
rank's reserved local page 0, which never holds a token. Under the flag the gauges are
instead the logical tokens the host tier holds and can hold: the host slots' owner-classed
allocator is replicated (identical on every rank), so every CP rank publishes the same
figures, and for the same requests ``used`` equals an unsharded server's.
"""

from __future__ import annotations

from typing import Any, Tuple

from sglang_cp_hicache.v0_5_23.cache.cache_extension import host_extension_of


def logical_host_tokens(host_pool: Any) -> Tuple[int, int]:
    """(used, total) logical tokens of a sharded host pool (``PageInterleaveHostPool``):
    total = every lane's allocatable pages, used = total - every lane's free pages."""
    slots = host_pool._slots  # upstream's owner-classed allocator over the host rows
    total = slots.size
    return total - slots.aggregate_free_size(), total


def log_hicache_stats_after(result: Any, reporter: Any, *args: Any, **kwargs: Any) -> None:
    """After ``SchedulerMetricsReporter._log_hicache_stats`` (through ``metrics_tick``'s
    hook, the one on that seam): the KV host gauges read logically where the cache's host pool is the sharded one (decided at ``init_hicache``)."""
    cache = reporter.scheduler.tree_cache
    if host_extension_of(cache) is None:
        return
    host_pool = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    used, total = logical_host_tokens(host_pool)
    reporter.stats.hicache_host_used_tokens = used
    reporter.stats.hicache_host_total_tokens = total


__all__ = ["log_hicache_stats_after", "logical_host_tokens"]
