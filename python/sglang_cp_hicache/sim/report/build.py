"""``build_report``: the ranks' results of every column into one ``SimReport``."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.report.balance import lane_balance
from sglang_cp_hicache.sim.report.columns import (
    ColumnSummary,
    column_problems,
    column_series,
    column_summary,
    cross_rank_checks,
    hit_rates,
    hot_by_name,
    leaks,
    op_stats,
)
from sglang_cp_hicache.sim.report.pd import PDSummary, pd_summary
from sglang_cp_hicache.sim.report.records import BaselineSummary, SimReport
from sglang_cp_hicache.sim.report.storage import StorageSummary, storage_summary
from sglang_cp_hicache.sim.results import PDDecodeStats, RankResult

if TYPE_CHECKING:
    from sglang_cp_hicache.sim.lines import Column, LineSim


def build_report(
    cfg: SimConfig,
    line: "LineSim",
    columns: List["Column"],
    results_by_column: Dict[str, List[RankResult]],
    num_requests: int,
    num_steps: int,
    wall_s: float,
    pd_decode: Optional[PDDecodeStats] = None,
) -> SimReport:
    """The report of one run: the main column (``columns[0]``) in the top-level fields,
    every column in ``columns`` (and the cp-1 replay also in ``baseline``); with
    ``pd_decode`` (``SimConfig.pd``) the main column's PD transfers, whose problems are
    violations of the run."""
    main = columns[0]
    results = results_by_column[main.name]
    violations = [v for r in results for v in r.violations] + cross_rank_checks(results)
    pd = pd_summary(results, pd_decode) if pd_decode is not None else None
    if pd is not None:
        violations += pd.problems
    summaries, column_violations, series = _columns(columns, results_by_column)
    baseline = results_by_column.get("upstream", [None])[0]
    series.update(_main_series(results, baseline))
    hot = hot_by_name(results)
    upstream_hot = summaries["upstream"].hot_path_collectives if "upstream" in summaries else None
    storage = storage_summary(
        results, results_by_column.get("upstream"), "native" in summaries,
        sum(hot.values()), upstream_hot, results_by_column.get("upstream_logical"),
    )  # fmt: skip
    native = results_by_column.get("native") if main.name != "native" else None
    return SimReport(
        # the layout that ran, also where the line's default chose it
        config=dataclasses.asdict(dataclasses.replace(cfg, mem_layout=line.resolved_mem_layout(cfg))),
        requests=num_requests,
        steps=num_steps,
        invariant_violations=violations + column_violations,
        hot_path_collectives=sum(hot.values()),
        hot_path_collectives_by_name=hot,
        op_time_us=op_stats(results),
        op_wall_us=op_stats(results, wall=True),
        baseline_op_time_us=op_stats([baseline]) if baseline is not None else None,
        baseline=_baseline_summary(baseline),
        wall_s=wall_s,
        series=series,
        sglang_release=line.release,
        columns=summaries,
        native_column_note=(
            f"SGLang {line.release} has no native KV sharding"
            if cfg.runs_native_column() and not line.native_sharding
            else None
        ),
        native_op_time_us=op_stats(native) if native is not None else None,
        **_proofs(results),
        **_cache_behaviour(results),
        **_traffic(results),
        **_pd_fields(pd),
        **_storage_fields(cfg, storage),
    )


def _columns(
    columns: List["Column"], results_by_column: Dict[str, List[RankResult]]
) -> Tuple[Dict[str, ColumnSummary], List[str], Dict[str, Any]]:
    """Every column's summary, the other columns' problems as the run's violations (named
    by column), and the per-column series."""
    summaries: Dict[str, ColumnSummary] = {}
    violations: List[str] = []
    series: Dict[str, Any] = {"columns": {}}
    prefixes = {"upstream": "baseline", "upstream_logical": "logical baseline"}
    for column in columns:
        column_results = results_by_column[column.name]
        problems = column_problems(column_results)
        if column is not columns[0]:
            prefix = prefixes.get(column.name, column.name)
            violations += [f"{prefix}: {p}" for p in problems]
        summaries[column.name] = column_summary(column, column_results, problems)
        series["columns"][column.name] = dict(label=column.label, **column_series(column_results))
    return summaries, violations, series


def _main_series(results: List[RankResult], baseline: Optional[RankResult]) -> Dict[str, Any]:
    """The main column's per-batch series (and the cp-1 replay's hit rate beside it)."""
    series: Dict[str, Any] = dict(
        requests=[p.requests for p in results[0].series],
        hit_rate=hit_rates(results[0]),
        host_physical_bytes_per_rank=[[p.host_physical_bytes for p in r.series] for r in results],
        host_logical_bytes=[p.host_logical_bytes for p in results[0].series],
    )
    if baseline is not None:
        series["baseline_requests"] = [p.requests for p in baseline.series]
        series["baseline_hit_rate"] = hit_rates(baseline)
    return series


def _baseline_summary(baseline: Optional[RankResult]) -> Optional[BaselineSummary]:
    if baseline is None:
        return None
    b = baseline.counters
    return BaselineSummary(
        device_hit_tokens=b.device_hit_tokens,
        host_hit_tokens=b.host_hit_tokens,
        load_backs=b.load_backs,
        device_evicted_tokens=b.device_evicted_tokens,
        host_evicted_tokens=b.host_evicted_tokens,
        hit_rate=(b.device_hit_tokens + b.host_hit_tokens) / max(1, b.prompt_tokens),
        host_peak_bytes=baseline.host_peak_physical_bytes,
        d2h_bytes=baseline.d2h_bytes,
        h2d_bytes=baseline.h2d_bytes,
        kv_mismatches=b.kv_mismatches,
        rejected_insert_tokens=b.rejected_insert_tokens,
        rejected_insert_hit_tokens=b.rejected_insert_hit_tokens,
        storage_hit_tokens=b.storage_hit_tokens,
        storage_written_bytes=baseline.storage.written_bytes if baseline.storage else 0,
        storage_read_bytes=baseline.storage.read_bytes if baseline.storage else 0,
    )


def _proofs(results: List[RankResult]) -> Dict[str, Any]:
    """What the main column proves: bytes checked, ranks identical, nothing leaked."""
    leaked_device, leaked_host = leaks(results)
    return dict(
        kv_mismatches=sum(r.counters.kv_mismatches for r in results),
        kv_checked_tokens=sum(r.counters.kv_checked_tokens for r in results),
        radix_digests=[r.tree_digest for r in results],
        decision_hashes=[r.decision_hash for r in results],
        writing_check_all_reduces=[r.allowed_collectives for r in results],
        leaked_device_slots=leaked_device,
        leaked_host_slots=leaked_host,
        draft=bool(results[0].draft_bytes_per_token),
        draft_kv_mismatches=sum(r.counters.draft_kv_mismatches for r in results),
        draft_kv_checked_tokens=sum(r.counters.draft_kv_checked_tokens for r in results),
    )


def _cache_behaviour(results: List[RankResult]) -> Dict[str, Any]:
    """The main column's replicated counters (rank 0's: identical on every rank)."""
    c = results[0].counters
    counters = ("prompt_tokens", "device_hit_tokens", "host_hit_tokens", "host_matched_tokens",
                "load_backs", "load_back_failures", "device_evicted_tokens", "device_dropped_tokens",
                "host_evicted_tokens", "prefill_chunks", "aborted_requests", "retracted_requests",
                "deferred_requests", "pending_committed", "pending_rolled_back", "deferred_splits",
                "backups_skipped_host_full", "per_layer_forwards", "per_layer_layers", "per_layer_acks",
                "per_layer_l3_writes", "rejected_inserts", "rejected_insert_tokens",
                "rejected_insert_hit_tokens")  # fmt: skip
    return dict(
        {name: getattr(c, name) for name in counters},
        hit_rate=(c.device_hit_tokens + c.host_hit_tokens) / max(1, c.prompt_tokens),
        device_evictions=c.device_evicted_nodes,
        host_evictions=c.host_evicted_nodes,
    )


def _traffic(results: List[RankResult]) -> Dict[str, Any]:
    """The main column's memory and bytes moved per rank, beside what a replicated tier
    would hold and move."""
    c, bpt = results[0].counters, results[0].bytes_per_token
    return dict(
        bytes_per_token=bpt,
        logical_host_bytes=results[0].host_peak_logical_bytes,
        host_bytes_per_rank=[r.host_peak_physical_bytes for r in results],
        d2h_bytes_per_rank=[r.d2h_bytes for r in results],
        h2d_bytes_per_rank=[r.h2d_bytes for r in results],
        replicated_d2h_bytes=c.logical_written_tokens * bpt,
        replicated_h2d_bytes=c.logical_loaded_tokens * bpt,
        balance=lane_balance(results),
        draft_bytes_per_token=results[0].draft_bytes_per_token,
        draft_host_bytes_per_rank=[r.draft_host_peak_bytes for r in results],
        draft_d2h_bytes_per_rank=[r.draft_d2h_bytes for r in results],
        draft_h2d_bytes_per_rank=[r.draft_h2d_bytes for r in results],
    )


def _pd_fields(pd: Optional[PDSummary]) -> Dict[str, Any]:
    return dict(
        pd=pd is not None,
        pd_transferred_tokens=pd.transferred_tokens if pd else 0,
        pd_kv_mismatches=pd.kv_mismatches if pd else 0,
        pd_sent_bytes_per_rank=pd.sent_bytes_per_rank if pd else [],
        pd_summary=pd,
    )


def _storage_fields(cfg: SimConfig, storage: Optional[StorageSummary]) -> Dict[str, Any]:
    return dict(
        storage_backend=cfg.storage_backend,
        storage_hit_tokens=storage.hit_tokens if storage else 0,
        storage_written_bytes_per_rank=storage.written_bytes_per_rank if storage else [],
        storage_read_bytes_per_rank=storage.read_bytes_per_rank if storage else [],
        storage_summary=storage,
    )
