"""One column of the comparison (one implementation's replay of the trace): its checks
across ranks (digests, decision logs, replicated counters, bytes moved once by their
owner), its ``ColumnSummary`` and its per-op times."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List

import numpy as np

from sglang_cp_hicache.sim.report.balance import max_over_mean
from sglang_cp_hicache.sim.results import OPS, RankCounters, RankResult

if TYPE_CHECKING:
    from sglang_cp_hicache.sim.lines import Column

_PER_RANK_FIELDS = ("kv_checked_tokens", "kv_mismatches", "draft_kv_checked_tokens", "draft_kv_mismatches")


@dataclass
class ColumnSummary:
    """One column of the comparison: one implementation's replay of the same trace, with
    every invariant checked (``passed``: its own checks, as ``SimReport.passed`` for the
    main column). Byte lists have one entry per rank of that replay."""

    name: str  # "plugin" | "native" | "upstream" (lines.COLUMNS)
    label: str
    world_size: int
    passed: bool
    violations: int
    kv_mismatches: int
    kv_checked_tokens: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    load_backs: int
    hit_rate: float
    device_evicted_tokens: int
    host_evicted_tokens: int
    rejected_inserts: int
    rejected_insert_tokens: int  # refused by the tree (rotation-run joins under sharding)
    rejected_insert_hit_tokens: int  # hits they cost (upper bound)
    device_lane_peak_skew: float  # max/mean over owner lanes; 1.0 for one rank
    host_lane_peak_skew: float
    host_bytes_per_rank: List[int]  # peak, physical
    d2h_bytes_per_rank: List[int]
    h2d_bytes_per_rank: List[int]
    hot_path_collectives: int
    leaked_slots: int  # device + req + host slots over ranks
    backups_skipped_host_full: int = 0  # backups dropped for want of host room (replicated)
    # L3 storage (SimConfig.storage_backend; empty where the column ran without it)
    storage_backend_class: str = ""
    storage_hit_tokens: int = 0  # of host_hit_tokens, prefetched from L3 first
    storage_written_bytes_per_rank: List[int] = field(default_factory=list)
    storage_read_bytes_per_rank: List[int] = field(default_factory=list)
    storage_prior_run_read_pages: int = 0  # pages read that an earlier run had stored



def op_stats(results: List[RankResult], wall: bool = False) -> Dict[str, Dict[str, float]]:
    stats: Dict[str, Dict[str, float]] = {}
    for op in OPS:
        per_rank = [r.op_wall_samples_us if wall else r.op_samples_us for r in results]
        samples = np.array([s for samples in per_rank for s in samples.get(op, [])], dtype=float)
        if len(samples) == 0:
            stats[op] = {"count": 0, "p50": 0.0, "p99": 0.0, "mean": 0.0}
            continue
        stats[op] = {
            "count": int(len(samples)),
            "p50": float(np.percentile(samples, 50)),
            "p99": float(np.percentile(samples, 99)),
            "mean": float(samples.mean()),
        }
    return stats


def _replicated(counters: RankCounters) -> Dict[str, int]:
    return {k: v for k, v in dataclasses.asdict(counters).items() if k not in _PER_RANK_FIELDS}


def cross_rank_checks(results: List[RankResult]) -> List[str]:
    problems: List[str] = []
    if len({r.tree_digest for r in results}) > 1:
        digests = [r.tree_digest for r in results]
        problems.append(f"radix tree digests differ across ranks: {digests}")
    if len({r.decision_hash for r in results}) > 1:
        problems.append(f"decision logs differ across ranks: {[r.decision_hash for r in results]}")
    reference = _replicated(results[0].counters)
    for r in results[1:]:
        other = _replicated(r.counters)
        diff = {k: (reference[k], other[k]) for k in reference if reference[k] != other[k]}
        if diff:
            problems.append(f"rank {r.rank} counters differ from rank 0: {diff}")
    c = results[0].counters
    hit_tokens = c.device_hit_tokens + c.host_hit_tokens
    checked = sum(r.counters.kv_checked_tokens for r in results)
    if checked != hit_tokens:
        # Every hit token has exactly one owner, which checks it.
        problems.append(f"{checked} hit tokens checked across ranks, {hit_tokens} hit")
    bpt, draft_bpt = results[0].bytes_per_token, results[0].draft_bytes_per_token
    if draft_bpt:
        draft_checked = sum(r.counters.draft_kv_checked_tokens for r in results)
        if draft_checked != hit_tokens:
            problems.append(f"{draft_checked} hit tokens' draft KV checked across ranks, {hit_tokens} hit")
    for name, per_rank, logical in (
        ("D2H", [r.d2h_bytes for r in results], c.logical_written_tokens * bpt),
        ("H2D", [r.h2d_bytes for r in results], c.logical_loaded_tokens * bpt),
        ("draft D2H", [r.draft_d2h_bytes for r in results], c.logical_written_tokens * draft_bpt),
        ("draft H2D", [r.draft_h2d_bytes for r in results], c.logical_loaded_tokens * draft_bpt),
    ):
        if sum(per_rank) != logical:
            # Each logical page moves exactly once, on its owner.
            problems.append(f"{name} bytes over ranks {sum(per_rank)} != logical {logical}")
    return problems


def hit_rates(result: RankResult) -> List[float]:
    return [p.hit_tokens / max(1, p.prompt_tokens) for p in result.series]


def hot_by_name(results: List[RankResult]) -> Dict[str, int]:
    hot: Dict[str, int] = {}
    for r in results:
        for name, count in r.hot_path_collectives.items():
            hot[name] = hot.get(name, 0) + count
    return hot


def leaks(results: List[RankResult]) -> tuple:
    device = sum(abs(r.leaked_device_slots) + abs(r.leaked_req_slots) for r in results)
    return device, sum(abs(r.leaked_host_slots) for r in results)


def column_problems(results: List[RankResult]) -> List[str]:
    """Everything ``SimReport.passed`` checks besides the ranks' own violations, as
    messages: a comparison column passes or fails on the same invariants as the main one."""
    # A rank reports each hit with wrong bytes as a violation of its own.
    problems = [v for r in results for v in r.violations] + cross_rank_checks(results)
    hot = hot_by_name(results)
    if hot:
        problems.append(f"collectives on the scheduler path: {hot}")
    device, host = leaks(results)
    if device or host:
        problems.append(f"leaked device/req slots {device}, host slots {host} after the flush")
    return problems


def _lane_skews(results: List[RankResult]) -> tuple:
    lanes = results[0].lane_usage
    if lanes is None:  # one rank, one lane
        return 1.0, 1.0
    return max_over_mean(lanes.device_peak), max_over_mean(lanes.host_peak)


def column_summary(column: "Column", results: List[RankResult], problems: List[str]) -> ColumnSummary:
    c = results[0].counters
    device_skew, host_skew = _lane_skews(results)
    device_leaks, host_leaks = leaks(results)
    return ColumnSummary(
        name=column.name,
        label=column.label,
        world_size=len(results),
        passed=not problems,
        violations=len(problems),
        kv_mismatches=sum(r.counters.kv_mismatches for r in results),
        kv_checked_tokens=sum(r.counters.kv_checked_tokens for r in results),
        prompt_tokens=c.prompt_tokens,
        device_hit_tokens=c.device_hit_tokens,
        host_hit_tokens=c.host_hit_tokens,
        load_backs=c.load_backs,
        hit_rate=(c.device_hit_tokens + c.host_hit_tokens) / max(1, c.prompt_tokens),
        device_evicted_tokens=c.device_evicted_tokens,
        host_evicted_tokens=c.host_evicted_tokens,
        rejected_inserts=c.rejected_inserts,
        rejected_insert_tokens=c.rejected_insert_tokens,
        rejected_insert_hit_tokens=c.rejected_insert_hit_tokens,
        device_lane_peak_skew=device_skew,
        host_lane_peak_skew=host_skew,
        host_bytes_per_rank=[r.host_peak_physical_bytes for r in results],
        d2h_bytes_per_rank=[r.d2h_bytes for r in results],
        h2d_bytes_per_rank=[r.h2d_bytes for r in results],
        hot_path_collectives=sum(hot_by_name(results).values()),
        leaked_slots=device_leaks + host_leaks,
        backups_skipped_host_full=c.backups_skipped_host_full,
        **_column_storage(results),
    )


def _column_storage(results: List[RankResult]) -> Dict[str, Any]:
    ranks = [r.storage for r in results]
    if ranks[0] is None:
        return {}
    return dict(
        storage_backend_class=ranks[0].backend_class,
        storage_hit_tokens=results[0].counters.storage_hit_tokens,
        storage_written_bytes_per_rank=[s.written_bytes for s in ranks],
        storage_read_bytes_per_rank=[s.read_bytes for s in ranks],
        storage_prior_run_read_pages=sum(s.prior_run_read_pages for s in ranks),
    )


def column_series(results: List[RankResult]) -> Dict[str, Any]:
    return {
        "requests": [p.requests for p in results[0].series],
        "hit_rate": hit_rates(results[0]),
        "host_physical_bytes_per_rank": [[p.host_physical_bytes for p in r.series] for r in results],
    }

