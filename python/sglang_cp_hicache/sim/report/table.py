"""``format_table``: the human-readable report (the CLI's stdout)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.sim.report.records import SimReport


def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _headline(report: SimReport) -> List[str]:
    cfg = report.config
    digests = "equal" if len(set(report.radix_digests)) == 1 else "DIFFER"
    draft = (
        f"draft_kv_mismatches={report.draft_kv_mismatches} "
        f"(checked {report.draft_kv_checked_tokens})  "
        if report.draft
        else ""
    )
    pd = f"pd_kv_mismatches={report.pd_kv_mismatches} (decode side)  " if report.pd else ""
    others = [
        f"{s.name} {'PASS' if s.passed else 'FAIL'}"
        for name, s in report.columns.items()
        if name != cfg["shard_impl"]
    ]
    return [
        f"CP HiCache simulator  SGLang {report.sglang_release}  cp_size={cfg['cp_size']}  "
        f"mem_layout={cfg['mem_layout']}  "
        f"seed={cfg['seed']}  requests={report.requests}  batches={report.steps}  "
        f"wall={report.wall_s:.1f}s",
        f"result: {'PASS' if report.passed else 'FAIL'}  ({cfg['shard_impl']} column"
        + (f"; {', '.join(others)}" if others else "")
        + ")  "
        f"kv_mismatches={report.kv_mismatches} (checked {report.kv_checked_tokens} hit tokens)  "
        f"{draft}{pd}"
        f"violations={len(report.invariant_violations)}  "
        f"hot_path_collectives={report.hot_path_collectives}  "
        f"leaked device/host slots={report.leaked_device_slots}/{report.leaked_host_slots}  "
        f"digests {digests}",
    ]


_LABEL_WIDTH, _CELL_WIDTH = 38, 17


def _table_slots(report: SimReport) -> List[tuple]:
    """(header, summary or None, cell for a column that did not run), in ``COLUMNS`` order."""
    from sglang_cp_hicache.sim.lines import COLUMNS

    cp = report.config["cp_size"]
    slots = []
    for name in COLUMNS:
        summary = report.columns.get(name)
        if summary is None and name == "upstream_logical":
            continue  # asked for by storage_logical_baseline only
        header = summary.label if summary else ("cp=1 upstream" if name == "upstream" else f"cp={cp} {name}")
        missing = "n/a" if name == "native" and report.native_column_note else "-"
        slots.append((header, summary, missing))
    return slots


def _cache_rows(report: SimReport) -> List[str]:
    """The three columns side by side (plugin, native, cp=1 upstream), then the main
    column's scheduler-feature counters."""
    slots = _table_slots(report)
    main = report.config["shard_impl"]
    lines = [f"{'':{_LABEL_WIDTH}}" + "".join(f"{h:>{_CELL_WIDTH}}" for h, _, _ in slots)]

    def row(label: str, cell: Any, main_only: bool = False) -> None:
        cells = []
        for _, summary, missing in slots:
            if summary is None or (main_only and summary.name != main):
                cells.append(missing if summary is None else "-")
            else:
                cells.append(str(cell(summary)))
        lines.append(f"{label:{_LABEL_WIDTH}}" + "".join(f"{c:>{_CELL_WIDTH}}" for c in cells))

    row("checks", lambda s: "PASS" if s.passed else f"FAIL ({s.violations})")
    row("prompt tokens", lambda s: s.prompt_tokens)
    row("device hit tokens", lambda s: s.device_hit_tokens)
    row("host hit tokens (loaded back)", lambda s: s.host_hit_tokens)
    if report.storage_summary is not None:
        row("  of which from L3 storage",
            lambda s: s.storage_hit_tokens if s.storage_backend_class else "no L3")  # fmt: skip
    row("host-hit load-backs", lambda s: s.load_backs)
    row("hit rate", lambda s: f"{s.hit_rate:.3f}")
    row("device evicted tokens", lambda s: s.device_evicted_tokens)
    row("host evicted tokens", lambda s: s.host_evicted_tokens)
    row("rejected inserts (tokens)", lambda s: f"{s.rejected_inserts} ({s.rejected_insert_tokens})")
    row("  hits they cost (upper bound)", lambda s: s.rejected_insert_hit_tokens)
    row("lane fill skew device/host (peak)",
        lambda s: f"{s.device_lane_peak_skew:.3f}/{s.host_lane_peak_skew:.3f}")  # fmt: skip
    row("device evictions (nodes)", lambda s: report.device_evictions, main_only=True)
    row("host evictions (nodes)", lambda s: report.host_evictions, main_only=True)
    row("load-back failures", lambda s: report.load_back_failures, main_only=True)
    row("chunks / aborts / retractions",
        lambda s: f"{report.prefill_chunks}/{report.aborted_requests}/{report.retracted_requests}",
        main_only=True)  # fmt: skip
    row("backups committed / rolled back",
        lambda s: f"{report.pending_committed}/{report.pending_rolled_back}", main_only=True)  # fmt: skip
    row("deferred splits (request-rounds)",
        lambda s: f"{report.deferred_splits} ({report.deferred_requests})", main_only=True)  # fmt: skip
    row("backups skipped, host full", lambda s: report.backups_skipped_host_full, main_only=True)
    row("per-layer fwds/layers/acks (0.5.23)",
        lambda s: f"{report.per_layer_forwards}/{report.per_layer_layers}/{report.per_layer_acks}",
        main_only=True)  # fmt: skip
    if report.per_layer_l3_writes:
        row("L3 writes of per-layer backups", lambda s: report.per_layer_l3_writes, main_only=True)
    row("writing_check all-reduces/rank", lambda s: report.writing_check_all_reduces[0], main_only=True)
    if report.native_column_note:
        lines.append(f"native column n/a: {report.native_column_note}")
    return lines


def _rank_rows(report: SimReport) -> List[str]:
    """Per-rank bytes of the main column against the replicated figures, then each other
    column's per-rank bytes."""
    widths = (9, 5, 16, 19, 13, 16, 13, 16)
    titles = ("column", "rank", "host peak phys", "host peak logical", "D2H", "D2H replicated",
              "H2D", "H2D replicated")  # fmt: skip

    def line(cells) -> str:
        return "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))

    main = report.config["shard_impl"]
    lines = [line(titles)]
    per_rank = zip(report.host_bytes_per_rank, report.d2h_bytes_per_rank, report.h2d_bytes_per_rank)
    for rank, (host, d2h, h2d) in enumerate(per_rank):
        lines.append(
            line(
                (main, rank, _mib(host), _mib(report.logical_host_bytes), _mib(d2h),
                 _mib(report.replicated_d2h_bytes), _mib(h2d), _mib(report.replicated_h2d_bytes))
            )  # fmt: skip
        )
    for name, summary in report.columns.items():
        if name == main:
            continue
        per_rank = zip(summary.host_bytes_per_rank, summary.d2h_bytes_per_rank, summary.h2d_bytes_per_rank)
        for rank, (host, d2h, h2d) in enumerate(per_rank):
            label = {"upstream": "base", "upstream_logical": "base x cp"}.get(name, name)
            lines.append(line((label, rank, _mib(host), "", _mib(d2h), "", _mib(h2d), "")))
    if report.draft:
        lines.append("MTP draft KV (same host slots, included in no column above): host peak / D2H / H2D")
        draft = zip(report.draft_host_bytes_per_rank, report.draft_d2h_bytes_per_rank,
                    report.draft_h2d_bytes_per_rank)  # fmt: skip
        for rank, (host, d2h, h2d) in enumerate(draft):
            lines.append(line(("draft", rank, _mib(host), "", _mib(d2h), "", _mib(h2d), "")))
    return lines


def _balance_rows(report: SimReport) -> List[str]:
    """Lane fill per lane (lane r is rank r's pools), then the skews."""
    b = report.balance

    def pair(peak: Any, final: Any) -> str:
        return f"{peak}/{final}"

    lines = [
        "owner lane fill, used pages peak/final (lane r = rank r), sampled after every batch",
        f"{'lane':>8}{'device':>16}{'host':>16}",
    ]
    lanes = zip(b.device_lane_peak_pages, b.device_lane_final_pages,
                b.host_lane_peak_pages, b.host_lane_final_pages)  # fmt: skip
    for lane, (dev_peak, dev_final, host_peak, host_final) in enumerate(lanes):
        lines.append(f"{lane:>8}{pair(dev_peak, dev_final):>16}{pair(host_peak, host_final):>16}")
    lines.append(
        f"{'max/mean':>8}"
        f"{pair(f'{b.device_lane_peak_skew:.3f}', f'{b.device_lane_final_skew:.3f}'):>16}"
        f"{pair(f'{b.host_lane_peak_skew:.3f}', f'{b.host_lane_final_skew:.3f}'):>16}"
    )
    lines.append(
        f"max-rank / mean:          host peak {b.host_peak_bytes_skew:.3f}x  "
        f"D2H {b.d2h_bytes_skew:.3f}x  H2D {b.h2d_bytes_skew:.3f}x"
    )
    lines.append(
        f"max-rank / (logical/cp):  host peak {b.host_peak_bytes_vs_logical:.3f}x  "
        f"D2H {b.d2h_bytes_vs_logical:.3f}x  H2D {b.h2d_bytes_vs_logical:.3f}x"
    )
    return lines


OpStats = Dict[str, Dict[str, float]]


def _p50_ratio(stats: Dict[str, float], other: Optional[Dict[str, float]]) -> Optional[float]:
    """``stats`` p50 over ``other``'s, or None where either did not run."""
    if other is None or other["p50"] <= 0 or stats["count"] == 0:
        return None
    return stats["p50"] / other["p50"]


def _ratio_cell(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _op_table(main: str, op_time_us: OpStats, comparisons: Sequence[Tuple[str, Optional[OpStats]]]) -> List[str]:
    """The per-op table: ``main``'s p50/p99, then per ``(name, stats or None)`` comparison
    its p50/p99 and ``main``'s p50 over it. The native comparison (same trace, same cp)
    isolates the plugin's deltas; the cp-1 upstream one adds cp x the logical cache and the
    all-reduce of cp > 1 on top."""
    header = f"{'op':14}{'n':>6}{main + ' p50':>13}{'p99':>10}"
    for name, _ in comparisons:
        header += f"{name + ' p50':>14}{'p99':>10}{main + '/' + name:>17}"
    lines = [
        "scheduler-thread CPU time per batch (us), pooled over ranks; the CPU runtime's "
        "synchronous copies are included; ratios of p50",
        header,
    ]
    for op, stats in op_time_us.items():
        line = f"{op:14}{stats['count']:>6}{stats['p50']:>13.1f}{stats['p99']:>10.1f}"
        for _, other_stats in comparisons:
            other = (other_stats or {}).get(op)
            p50 = f"{other['p50']:.1f}" if other else "-"
            p99 = f"{other['p99']:.1f}" if other else "-"
            line += f"{p50:>14}{p99:>10}{_ratio_cell(_p50_ratio(stats, other)):>17}"
        lines.append(line)
    return lines


def op_rows(report: SimReport) -> List[str]:
    main = report.config["shard_impl"]
    comparisons: List[Tuple[str, Optional[OpStats]]] = [("upstream", report.baseline_op_time_us)]
    if main != "native":
        comparisons.insert(0, ("native", report.native_op_time_us))
    return _op_table(main, report.op_time_us, comparisons)


# Per-op p50 ratios to native inside this band (either way) read as equal: the issue's
# bench target for the plugin's hooks (bench_radix_ops within 1.15x of native per op).
_OP_RATIO_BAND = 1.15


def _change(plugin: int, native: int) -> str:
    if plugin == native:
        return "same"
    pct = f", {100.0 * (plugin - native) / native:+.1f} %" if native else ""
    return f"{plugin - native:+d}{pct}"


def delta_rows(report: SimReport) -> List[str]:
    """Where the plugin's deltas matter on this run: each delta's figure in the plugin
    and native columns of the same trace, the mechanism behind it, and whether it moved."""
    cfg = report.config
    deltas = _deltas(report)
    moved = [name for name, differs, _ in deltas if differs]
    lines = [
        f"where the plugin's deltas matter: plugin vs native, same trace (workload {cfg['workload']}, "
        f"cp {cfg['cp_size']}, batch size {cfg['batch_size']}, seed {cfg['seed']})",
    ]
    lines += [f"  {name}: {text}" for name, _, text in deltas]
    lines.append(
        "  on this run they show in: " + (", ".join(moved) if moved else "nothing (plugin = native)")
        + "; other workloads and cp sizes: docs/simulator.md"
    )
    return lines


def _deltas(report: SimReport) -> List[Tuple[str, bool, str]]:
    """(delta, whether its figure differs from native's, the figures and why)."""
    p, n = report.columns["plugin"], report.columns["native"]
    cfg = report.config
    native_ops = report.native_op_time_us or {}
    ratios = {op: _p50_ratio(stats, native_ops.get(op)) for op, stats in report.op_time_us.items()}
    beyond = [
        f"{op} {_ratio_cell(ratio)}"
        for op, ratio in ratios.items()
        if ratio is not None and not 1 / _OP_RATIO_BAND <= ratio <= _OP_RATIO_BAND
    ]
    p_hits, n_hits = p.device_hit_tokens + p.host_hit_tokens, n.device_hit_tokens + n.host_hit_tokens
    per_layer = report.per_layer_forwards > 0
    return [
        ("hits", p_hits != n_hits,
         f"hit tokens {p_hits} vs {n_hits} ({_change(p_hits, n_hits)}), hit rate {p.hit_rate:.3f} vs "
         f"{n.hit_rate:.3f}: what the deltas below buy or cost"),
        ("lane-aware device eviction",
         p.device_evicted_tokens != n.device_evicted_tokens or p.device_lane_peak_skew != n.device_lane_peak_skew,
         f"device evicted tokens {p.device_evicted_tokens} vs {n.device_evicted_tokens} "
         f"({_change(p.device_evicted_tokens, n.device_evicted_tokens)}), device lane skew "
         f"{p.device_lane_peak_skew:.3f} vs {n.device_lane_peak_skew:.3f}: the plugin frees pages only on "
         "the owner lanes that are short, upstream's lane-blind walk also on lanes that were not; "
         "acts once the device pool is full"),
        ("lane-aware host room",
         p.backups_skipped_host_full != n.backups_skipped_host_full or p.host_evicted_tokens != n.host_evicted_tokens,
         f"backups skipped for want of host room {p.backups_skipped_host_full} vs "
         f"{n.backups_skipped_host_full}, host evicted tokens {p.host_evicted_tokens} vs "
         f"{n.host_evicted_tokens}: upstream's room counts tokens, not the backup's lanes, and skips "
         "a backup whose lane stays short; acts once the host pool is full"),
        ("batch-mates on one rotation run", p.rejected_inserts != n.rejected_inserts,
         f"rejected inserts {p.rejected_inserts} vs {n.rejected_inserts} (tokens {p.rejected_insert_tokens} "
         f"vs {n.rejected_insert_tokens}, hits they cost {p.rejected_insert_hit_tokens} vs "
         f"{n.rejected_insert_hit_tokens}): upstream declines a new chain's insert that joins two "
         "rotation runs, which needs two requests of one batch starting chains over one prefix"
         + (" (none at batch size 1: try --batch-size 4)" if cfg["batch_size"] == 1 else "")),
        ("per-layer D2H backup", per_layer,
         f"{'on' if per_layer else 'off'} ({report.per_layer_forwards} forwards): the plugin reserves "
         "host slots in alloc and copies each layer during the forward (not timed here), native "
         "copies all layers after it; scheduler time, not hits"
         + ("" if per_layer else "; on unless --all-layer-backup")),
        ("scheduler time", bool(beyond),
         f"ops whose p50 is beyond {_OP_RATIO_BAND}x of native's either way: "
         + (", ".join(beyond) if beyond else "none") + " (the per-op table above; one run's CPU "
         "times, noisy where cores are shared: benchmark/hicache/bench_radix_ops.py interleaves "
         "plugin and native call by call)"),
        ("L3 storage", bool(cfg["storage_backend"]),
         f"{cfg['storage_backend'] or 'off'}: upstream refuses --hicache-storage-backend under sharding, "
         "the plugin admits it (the L3 section above)" if cfg["storage_backend"]
         else "off: upstream refuses --hicache-storage-backend under sharding; see --storage-backend file "
         "and --workload l3"),
    ]


def _pd_rows(report: SimReport) -> List[str]:
    """The main column's PD transfers, as the decode process checked them."""
    pd = report.pd_summary
    t, d = pd.transfer_ms, pd.decode_transfer_ms
    sent = ", ".join(_mib(b) for b in pd.sent_bytes_per_rank)
    return [
        f"PD to one decode process over Mooncake (loopback TCP): {pd.transferred_requests} "
        f"requests, {pd.transferred_tokens} tokens; failed {pd.failed_transfers}",
        f"  decode-side checks: pd_kv_mismatches={pd.kv_mismatches} (draft {pd.draft_kv_mismatches})"
        f"  aux wrong={pd.aux_mismatches}  off-grant pages written={pd.off_grant_pages_changed}"
        f"  decode slots leaked={pd.decode_leaked_tokens}",
        f"  sent per rank: {sent}  (logical {_mib(pd.logical_bytes)}; max-rank / (logical/cp) "
        f"{pd.sent_bytes_vs_logical:.3f}x)",
        f"  per request: last chunk -> Success p50 {t['p50']:.1f} ms, p90 {t['p90']:.1f} ms; "
        f"decode prealloc -> transferred p50 {d['p50']:.1f} ms; in the engine "
        f"{pd.engine_ms_per_request:.1f} ms (busiest rank, mean)",
    ]


def _storage_rows(report: SimReport) -> List[str]:
    """The main column's L3 traffic beside the cp-1 upstream column's, and the targets."""
    st = report.storage_summary
    lines = [
        f"L3 storage: {st.backend} ({st.backend_class}); hit tokens {st.hit_tokens}"
        + (f" (upstream cp 1: {st.upstream_hit_tokens})" if st.upstream_hit_tokens is not None else "")
        + f"; pages read that an earlier run stored: {st.prior_run_read_pages}"
        + f"; rejected reads: {st.rejected_reads}",
        f"  prefetches issued {st.prefetches_issued}"
        + (f" (upstream cp 1: {st.upstream_prefetches_issued})" if st.upstream_prefetches_issued is not None else "")
        + f", not issued under a pending backup {st.anchor_skips}, re-issued at admission "
        f"{st.requeries}",
        f"  written per rank: {', '.join(_mib(b) for b in st.written_bytes_per_rank)}  "
        f"(max-rank / (logical/cp) {st.written_vs_logical:.3f}x)"
        + (f"; upstream cp 1: {_mib(st.upstream_written_bytes)}" if st.upstream_written_bytes is not None else ""),
        f"  read per rank:    {', '.join(_mib(b) for b in st.read_bytes_per_rank)}  "
        f"(max-rank / (logical/cp) {st.read_vs_logical:.3f}x)"
        + (f"; upstream cp 1: {_mib(st.upstream_read_bytes)}" if st.upstream_read_bytes is not None else ""),
        "  targets: " + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in st.targets.items()),
    ]
    if st.logical_upstream_hit_tokens is not None:
        lines.insert(-1, (
            f"  same logical L1 + L2 (upstream cp 1, cp x the pools): L3 hit tokens "
            f"{st.logical_upstream_hit_tokens}, all hit tokens {st.logical_upstream_hit_tokens_total} "
            f"(plugin: {st.hit_tokens}, {st.hit_tokens_total}); written "
            f"{_mib(st.logical_upstream_written_bytes)}, read {_mib(st.logical_upstream_read_bytes)}"
        ))  # fmt: skip
    if st.native_note:
        lines.append(f"  {st.native_note}")
    return lines


def format_table(report: SimReport) -> str:
    """The human-readable report (stdout of the CLI)."""
    lines = _headline(report) + [""] + _cache_rows(report) + [""] + _rank_rows(report)
    if report.pd_summary is not None:
        lines += [""] + _pd_rows(report)
    if report.storage_summary is not None:
        lines += [""] + _storage_rows(report)
    lines += [""] + _balance_rows(report)
    lines += [""] + op_rows(report)
    if "plugin" in report.columns and "native" in report.columns:
        lines += [""] + delta_rows(report)
    if report.invariant_violations:
        lines += ["", "violations (first 10):"]
        lines += [f"  {v}" for v in report.invariant_violations[:10]]
    return "\n".join(line.rstrip() for line in lines)
