"""Cache room: one ``CpCacheExtension`` per sharded ``UnifiedRadixCache``, the plugin's
state for that cache in one object (``cache_extension``), what the line sets up once
HiCache exists (``hicache_init``), the event check's all-reduce skipped by every rank
together while nothing is in flight (``event_sync``), the device tokens in use the
scheduler reports, counted over every free page (``pool_stats``), and upstream's host-tier
gauges read logically from the sharded host pool (``host_gauges``), and the plugin's own
Prometheus series (``plugin_metrics``, with ``--enable-metrics`` only; free pages and L3
counts read at the stats tick, ``metrics_tick``). Every other room's
per-call hook asks one question: is an extension attached? Exports its hook specs by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"

HOOKS: Tuple[HookSpec, ...] = (
    # Built with the cache when the record's mode (launch/cp_mode.py, settled at
    # resolution) shards KV; its host side and per-layer backup when HiCache is.
    HookSpec(
        f"{_URC}.__init__",
        "sglang_cp_hicache.v0_5_23.cache.cache_extension:cache_init_after",
        "AFTER",
    ),
    HookSpec(
        f"{_URC}.init_hicache",
        "sglang_cp_hicache.v0_5_23.cache.hicache_init:init_hicache_after",
        "AFTER",
    ),
    # The event check's MIN all-reduce: skipped on every rank alike while the replicated
    # pending maps are empty (no write or load in flight, no L3 tier).
    HookSpec(
        f"{_URC}._sync_hicache_ready_counts",
        "sglang_cp_hicache.v0_5_23.cache.event_sync:sync_ready_counts_around",
        "AROUND",
    ),
    # Tokens in use (/v1/loads, sglang:num_used_tokens) over every free page, not the
    # sharded allocator's admission floor (stranded pages of uneven lanes are not in use).
    HookSpec(
        "sglang.srt.managers.scheduler_components.pool_stats_observer:SchedulerPoolStatsObserver._get_token_info",
        "sglang_cp_hicache.v0_5_23.cache.pool_stats:token_info_after",
        "AFTER",
    ),
    # sglang:hicache_host_used_tokens / _total_tokens: the sharded host pool's logical
    # tokens, not its admission floor (available_size: the tightest lane x the CP size);
    # then the plugin's own series read at the same tick (free pages per owner lane and
    # tier, the L3 backend's counts; none without --enable-metrics).
    HookSpec(
        "sglang.srt.managers.scheduler_components.metrics_reporter:SchedulerMetricsReporter._log_hicache_stats",
        "sglang_cp_hicache.v0_5_23.cache.metrics_tick:stats_tick_after",
        "AFTER",
    ),
)
