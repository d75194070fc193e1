"""The plugin's gauges and polled counts, read at upstream's stats tick.

AFTER ``SchedulerMetricsReporter._log_hicache_stats`` (called on every stats tick of a
scheduler that logs metrics, HiCache or not; the one hook on that seam): upstream's host
gauges read logically first (``host_gauges``), then, on a cache with an extension, the free
pages per owner lane of the device allocator and, over the sharded host pool, of the host
slots (both replicated: every CP rank publishes the same figures), and the attached L3
backend's own counts. Without ``--enable-metrics`` the extension's series are
``plugin_metrics.NO_METRICS`` and this reads nothing it publishes.
"""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
from sglang_cp_hicache.v0_5_23.cache.host_gauges import log_hicache_stats_after


def stats_tick_after(result: Any, reporter: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``SchedulerMetricsReporter._log_hicache_stats``: upstream's host gauges read
    logically, then the plugin's tick readings."""
    log_hicache_stats_after(result, reporter)
    cache = reporter.scheduler.tree_cache
    extension = extension_of(cache)
    if extension is None:
        return
    metrics = extension.metrics
    metrics.set_free_pages("device", extension.allocator.class_free_page_counts())
    controller = cache.cache_controller
    if controller is None:
        return
    if extension.host_lanes:
        host_pool = controller.mem_pool_host.anchor_entry.host_pool
        metrics.set_free_pages("host", host_pool._slots.class_free_page_counts())
    metrics.sync_l3(controller.storage_backend)


__all__ = ["stats_tick_after"]
