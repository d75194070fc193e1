"""The plugin's own Prometheus series (``sglang:cp_hicache_*``, ``docs/metrics.md``) read
from the real servers' ``/metrics`` by a serving scenario (``lane_pressure``)."""

from __future__ import annotations

from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.recorder import Recorder
from sglang_cp_hicache.testing.server.session import ServingSession


def check_plugin_metrics(rec: Recorder, session: ServingSession, before: Metrics) -> None:
    """The plugin's own series on the sharded prefill's ``/metrics``: the device plans moved
    with the lane pressure, each logical series the same on every CP rank, free pages
    published for every owner lane of both tiers by the stats-logging rank (upstream's
    scheduler gauges: CP rank 0 unless ``--enable-metrics-for-all-schedulers``); none on
    the unsharded reference."""
    after, reference = session.sharded.metrics(), session.reference.metrics()
    plans = "sglang:cp_hicache_lane_eviction_plans_total"
    moved = after.total(plans, tier="device") - before.total(plans, tier="device")
    rec.expect(moved > 0, f"{plans}{{tier=device}} did not move under lane pressure")
    per_rank = after.per_rank(plans)
    rec.expect(len(per_rank) == session.tp and len(set(per_rank.values())) == 1,
               f"{plans} per CP rank is not one logical figure: {per_rank}")  # fmt: skip
    lanes = {(dict(l)["tp_rank"], dict(l)["tier"], dict(l)["lane"]) for n, l, _ in after.samples
             if n == "sglang:cp_hicache_free_pages"}  # fmt: skip
    wanted = {("0", tier, str(lane)) for tier in ("device", "host") for lane in range(session.tp)}
    rec.expect(lanes == wanted, f"free pages published for {sorted(lanes)}, wanted {sorted(wanted)}")
    theirs = sorted({n for n, _, _ in reference.samples if n.startswith("sglang:cp_hicache_")})
    rec.expect(not theirs, f"the unsharded reference publishes plugin series: {theirs}")
    rec.note(f"{moved / session.tp:.0f} device lane plans per rank in /metrics, free pages for {len(lanes)} (rank, tier, lane)")


__all__ = ["check_plugin_metrics"]
