"""The plugin's own Prometheus series, one :class:`CpCacheMetrics` per sharded cache.

Built with the cache's extension, once, only where upstream built the cache's own
collector (``--enable-metrics``: ``UnifiedRadixCache.metrics_collector``); otherwise the
extension holds :data:`NO_METRICS`, whose calls do nothing, so no plugin series exists and
no call site asks again. Series are named ``sglang:cp_hicache_*`` and carry the cache
collector's labels (``cache_type``, ``tp_rank``, ``pp_rank``, ``dp_rank``, upstream's extra
labels) plus ``attn_cp_rank``, as upstream's storage series do; every CP rank publishes its
own copy. What each counts, and whether it is logical (every rank the same) or per rank:
``docs/metrics.md``, "The plugin's own metrics".

They move where the plugin decides: lane eviction plans, refusals and pages freed per tier
and path (through the extension's :class:`LaneEvictionStats`), new chains kept on a
batch-mate's rotation run, per-layer backup latency (from the ack's timeline once upstream
pops it); and at each stats tick (upstream's ``_log_hicache_stats``): free pages per owner
lane and tier, and the L3 backend's own counts (:class:`L3Health`).
"""

from __future__ import annotations

import weakref
from dataclasses import astuple, dataclass, fields
from typing import Any, Dict, Optional, Sequence

#: The per-layer backup's histogram buckets (seconds): upstream's backup-duration set up
#: to 10 s (a forward's layers take milliseconds to seconds).
LAYER_BACKUP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)


@dataclass(frozen=True)
class L3Health:
    """An L3 backend's own counts since it was built (the plugin's backends report them,
    ``storage/``): reads refused for a file of the wrong size, Mooncake master outages
    seen and the master found listening again after one, batches the client answered
    ``RPC_FAIL`` and batches answered failed without calling it (master known down)."""

    rejected_reads: int = 0
    outages: int = 0
    reconnects: int = 0
    failed_batches: int = 0
    skipped_batches: int = 0


class TierSeries:
    """One tier's lane-aware room, by path: plans carried out, pages they freed, and
    refusals (an uncoverable deficit, nothing evicted: on host the backup is skipped)."""

    def __init__(self, plans: Any, pages: Any, refusals: Any, page_size: int) -> None:
        self._plans, self._pages, self._refusals = plans, pages, refusals
        self._page_size = page_size

    def planned(self, path: str, evicted_tokens: int) -> None:
        self._plans.labels(path=path).inc()
        self._pages.labels(path=path).inc(evicted_tokens // self._page_size)

    def refused(self, path: str) -> None:
        self._refusals.labels(path=path).inc()


class _NoTier:
    def planned(self, path: str, evicted_tokens: int) -> None:
        pass

    def refused(self, path: str) -> None:
        pass


class NoCacheMetrics:
    """A cache without ``--enable-metrics``: every call does nothing."""

    device: Any = _NoTier()
    host: Any = _NoTier()

    def set_free_pages(self, tier: str, free_per_lane: Sequence[int]) -> None:
        pass

    def sync_l3(self, backend: Any) -> None:
        pass

    def kept_on_run(self, chains: int) -> None:
        pass

    def observe_layer_backup(self, timeline: Any) -> None:
        pass


NO_METRICS = NoCacheMetrics()


class CpCacheMetrics:
    """The series of one sharded cache. ``labels``: the cache collector's, with
    ``attn_cp_rank``; ``registry``: prometheus_client's default unless given (a test's)."""

    def __init__(self, labels: Dict[str, Any], page_size: int, registry: Any = None) -> None:
        from prometheus_client import REGISTRY

        self._registry = REGISTRY if registry is None else registry
        self._labels = {key: str(value) for key, value in labels.items()}
        self.free_pages = self._gauge(
            "free_pages", "Free pages per owner lane of a tier (device: the sharded "
            "allocator's, host: the sharded host pool's slots); logical: every CP rank "
            "publishes the same figures.", ("tier", "lane"),
        )  # fmt: skip
        plans = self._counter(
            "lane_eviction_plans_total", "Lane-aware eviction plans carried out, by tier and "
            "by who asked (path); logical.", ("tier", "path"),
        )  # fmt: skip
        pages = self._counter(
            "lane_evicted_pages_total", "Logical pages freed by lane-aware eviction plans, "
            "by tier and path; logical.", ("tier", "path"),
        )  # fmt: skip
        skipped = self._counter(
            "backups_skipped_total", "Host room refused for want of room on a short "
            "owner lane (nothing evicted): a backup (backup, layer_backup) skipped, or an "
            "L3 hit not loaded (storage_hit); logical.", ("path",),
        )  # fmt: skip
        refused = self._counter(
            "device_room_refusals_total", "Device room refused on a short owner lane "
            "(nothing evicted): the extend runs out of memory or the load-back is "
            "skipped, as when upstream's walk runs dry; logical.", ("path",),
        )  # fmt: skip
        self.device = TierSeries(plans.bind(tier="device"), pages.bind(tier="device"), refused, page_size)
        self.host = TierSeries(plans.bind(tier="host"), pages.bind(tier="host"), skipped, page_size)
        self._kept_on_run = self._counter(
            "inserts_kept_on_run_total", "New chains of an extend batch placed at an "
            "earlier request's rotation base (their prompts share its first page), so their "
            "inserts join one rotation run; upstream would decline them; logical.", (),
        )  # fmt: skip
        self._l3 = self._l3_series()
        self._l3_source: Optional[weakref.ref] = None
        self._l3_seen = L3Health()
        self._init_layer_backup()

    def _l3_series(self) -> Dict[str, Any]:
        """The counter each :class:`L3Health` count feeds (this rank's backend: physical)."""
        rejected = self._counter(
            "l3_rejected_reads_total", "L3 reads refused for a file of the wrong size (torn, "
            "short or foreign: a miss), file backend; this rank.", (),
        )  # fmt: skip
        outages = self._counter(
            "l3_master_outages_total", "Mooncake master outages seen (a batch answered "
            "RPC_FAIL by the client); this rank.", (),
        )  # fmt: skip
        reconnects = self._counter(
            "l3_master_reconnects_total", "The Mooncake master found listening again after "
            "an outage; this rank.", (),
        )  # fmt: skip
        failed = self._counter(
            "l3_failed_batches_total", "L3 batches answered failed while the master is down: "
            "by the client (RPC_FAIL) or by the plugin without calling it (outage); this rank.",
            ("by",),
        )  # fmt: skip
        return {
            "rejected_reads": rejected, "outages": outages, "reconnects": reconnects,
            "failed_batches": failed.labels(by="client"), "skipped_batches": failed.labels(by="outage"),
        }  # fmt: skip

    def _init_layer_backup(self) -> None:
        self._first_layer = self._histogram(
            "layer_backup_first_layer_seconds", "Per-layer backup, this rank: layer 0's "
            "stores to layer 0's copy on host.",
        )  # fmt: skip
        self._tail = self._histogram(
            "layer_backup_tail_seconds", "Per-layer backup, this rank: the forward's last "
            "stores to the batch's last copy on host (the backup the forward does not hide).",
        )  # fmt: skip
        self._batches = self._counter(
            "layer_backup_batches_total", "Per-layer backup batches on this rank, by whether "
            "layer 0 was on host before the forward's last stores.", ("first_layer_on_host",),
        )  # fmt: skip

    # ------------------------------------------------------------------ the series
    def _series(self, cls: Any, name: str, doc: str, names: Sequence[str], **kw: Any) -> Any:
        metric = cls(
            name=f"sglang:cp_hicache_{name}", documentation=doc,
            labelnames=[*self._labels, *names], registry=self._registry, **kw,
        )  # fmt: skip
        return metric.labels(**self._labels) if not names else _Bound(metric, self._labels)

    def _counter(self, name: str, doc: str, names: Sequence[str]) -> Any:
        from prometheus_client import Counter

        return self._series(Counter, name, doc, names)

    def _gauge(self, name: str, doc: str, names: Sequence[str]) -> Any:
        from prometheus_client import Gauge

        return self._series(Gauge, name, doc, names, multiprocess_mode="mostrecent")

    def _histogram(self, name: str, doc: str) -> Any:
        from prometheus_client import Histogram

        return self._series(Histogram, name, doc, (), buckets=LAYER_BACKUP_BUCKETS)

    # ------------------------------------------------------------------ the readings
    def set_free_pages(self, tier: str, free_per_lane: Sequence[int]) -> None:
        for lane, free in enumerate(free_per_lane):
            self.free_pages.labels(tier=tier, lane=str(lane)).set(free)

    def sync_l3(self, backend: Any) -> None:
        """Bring the L3 counters up to ``backend``'s :class:`L3Health` (a backend that
        reports none, or none attached: nothing); a new backend counts from zero."""
        health = getattr(backend, "l3_health", None)
        if health is None:
            return
        if self._l3_source is None or self._l3_source() is not backend:
            self._l3_source, self._l3_seen = weakref.ref(backend), L3Health()
        now = health()
        for field, seen, value in zip(fields(L3Health), astuple(self._l3_seen), astuple(now)):
            if value > seen:
                self._l3[field.name].inc(value - seen)
        self._l3_seen = now

    def kept_on_run(self, chains: int) -> None:
        if chains:
            self._kept_on_run.inc(chains)

    def observe_layer_backup(self, timeline: Any) -> None:
        """One per-layer batch's timing events (``core.per_layer_backup.BatchTimeline``),
        all complete (its ack was popped)."""
        self._first_layer.observe(timeline.first_stored.elapsed_time(timeline.first_on_host) / 1e3)
        self._tail.observe(max(timeline.last_stored.elapsed_time(timeline.finished), 0.0) / 1e3)
        before = timeline.first_on_host.elapsed_time(timeline.last_stored) > 0
        self._batches.labels(first_layer_on_host="before_forward_end" if before else "after_forward_end").inc()


class _Bound:
    """A labelled family with some labels filled in (the cache's, ...): ``labels(**the
    rest)`` is the child."""

    def __init__(self, metric: Any, labels: Dict[str, str]) -> None:
        self._metric, self._labels = metric, labels

    def labels(self, **rest: str) -> Any:
        return self._metric.labels(**self._labels, **rest)

    def bind(self, **more: str) -> "_Bound":
        """This family with ``more`` of its labels filled in too."""
        return _Bound(self._metric, {**self._labels, **more})


def cache_metrics(cache: Any, page_size: int) -> Any:
    """:class:`CpCacheMetrics` for ``cache`` when upstream built its collector
    (``--enable-metrics``), else :data:`NO_METRICS`: decided once, with the extension."""
    collector = cache.metrics_collector
    if collector is None:
        return NO_METRICS
    from sglang.srt.runtime_context import get_parallel

    labels = dict(collector.labels, attn_cp_rank=get_parallel().attn_cp_rank)
    return CpCacheMetrics(labels, page_size)


__all__ = [
    "CpCacheMetrics",
    "L3Health",
    "LAYER_BACKUP_BUCKETS",
    "NO_METRICS",
    "NoCacheMetrics",
    "TierSeries",
    "cache_metrics",
]
