"""End-to-end tests of the multi-rank CPU simulator on the 0.5.23 line: the real 0.5.23
cache stack on gloo ranks, three columns (the plugin's, upstream's native sharding alone,
cp-1 upstream) with every invariant checked for each, and the checkers fail when a bug is
planted (so a green run means something)."""

import json
from pathlib import Path

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, parse_args
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.report.records import SimReport
from sglang_cp_hicache.sim.results import OPS
from sglang_cp_hicache.sim.simulation import run_simulation

# One column, no comparison replays: what the checker and feature tests need.
NATIVE_ONLY = dict(shard_impl="native", native_column=False, baseline=False, timeout_s=120)


def _assert_promises(report: SimReport, cp_size: int) -> None:
    """Every invariant of the main column (the others: their ``ColumnSummary.passed``)."""
    assert report.invariant_violations == []
    assert report.kv_mismatches == 0
    assert report.kv_checked_tokens == report.device_hit_tokens + report.host_hit_tokens > 0
    assert len(report.radix_digests) == cp_size and len(set(report.radix_digests)) == 1
    assert len(set(report.decision_hashes)) == 1
    assert report.hot_path_collectives == 0
    assert all(n > 0 for n in report.writing_check_all_reduces)  # upstream's own did run
    assert report.leaked_device_slots == 0 and report.leaked_host_slots == 0
    # Sharded: each rank stores and moves only its own pages, and they add up.
    assert all(0 < b < report.logical_host_bytes for b in report.host_bytes_per_rank)
    assert sum(report.d2h_bytes_per_rank) == report.replicated_d2h_bytes > 0
    assert sum(report.h2d_bytes_per_rank) == report.replicated_h2d_bytes
    assert set(report.op_time_us) == set(OPS)
    assert report.passed


@pytest.fixture(scope="module")
def cp2_report() -> SimReport:
    """The default columns at cp 2: plugin (main), native, cp=1 upstream."""
    return run_simulation(SimConfig(cp_size=2, seed=0, num_requests=30, timeout_s=120))


def test_three_columns_each_pass_every_check(cp2_report: SimReport) -> None:
    report = cp2_report
    assert report.sglang_release == "0.5.23" and report.config["shard_impl"] == "plugin"
    _assert_promises(report, 2)
    assert list(report.columns) == ["plugin", "native", "upstream"]
    for summary in report.columns.values():
        assert summary.passed, summary
        assert summary.kv_mismatches == 0 and summary.hot_path_collectives == 0 and summary.leaked_slots == 0
        assert summary.prompt_tokens == report.prompt_tokens
        assert summary.kv_checked_tokens == summary.device_hit_tokens + summary.host_hit_tokens
    plugin, native, upstream = (report.columns[n] for n in ("plugin", "native", "upstream"))
    assert plugin.world_size == native.world_size == 2 and upstream.world_size == 1
    # Both tiers were under pressure and the host tier served hits, in every column.
    for summary in (plugin, native, upstream):
        assert summary.host_hit_tokens > 0 and summary.device_evicted_tokens > 0 and summary.host_evicted_tokens > 0
    # cp x the logical device pool for the same per-rank memory: more device hits.
    assert native.device_hit_tokens > upstream.device_hit_tokens
    assert len(upstream.host_bytes_per_rank) == 1 and len(native.d2h_bytes_per_rank) == 2
    assert report.baseline is not None and report.baseline.device_hit_tokens == upstream.device_hit_tokens


def test_table_and_json_carry_every_column(cp2_report: SimReport, tmp_path: Path) -> None:
    from sglang_cp_hicache.sim.report.table import format_table

    table = format_table(cp2_report)
    assert "SGLang 0.5.23" in table
    for header in ("cp=2 plugin", "cp=2 native", "cp=1 upstream", "rejected inserts", "lane fill skew",
                   "plugin/native", "plugin/upstream", "where the plugin's deltas matter"):  # fmt: skip
        assert header in table, header
    # The per-op comparison with native is the native column's own replay of the trace.
    assert set(cp2_report.native_op_time_us) == set(cp2_report.op_time_us)
    assert cp2_report.native_op_time_us != cp2_report.baseline_op_time_us
    path = tmp_path / "report.json"
    cp2_report.write_json(str(path))
    data = json.loads(path.read_text())
    assert set(data["columns"]) == {"plugin", "native", "upstream"}
    assert set(data["series"]["columns"]) == {"plugin", "native", "upstream"}
    for name in ("rejected_insert_tokens", "rejected_insert_hit_tokens", "host_lane_peak_skew", "d2h_bytes_per_rank"):
        assert name in data["columns"]["native"], name
    series = data["series"]["columns"]["native"]
    assert len(series["requests"]) == len(series["hit_rate"]) and len(series["host_physical_bytes_per_rank"]) == 2


def test_plot_has_every_column_or_refuses_clearly(cp2_report: SimReport, tmp_path: Path) -> None:
    """``--plot`` needs matplotlib, which the 0.5.23 CPU list may not pin: with it, a PNG;
    without it, the one clear refusal (never a half-written file)."""
    from sglang_cp_hicache.sim.plot import PlotUnavailable, write_plot

    plot = tmp_path / "sim.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(PlotUnavailable, match="needs matplotlib"):
            write_plot(cp2_report, str(plot))
        assert not plot.exists()
        return
    write_plot(cp2_report, str(plot))
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cp3_plugin_and_native_with_chunks_aborts_retractions_and_writes_in_flight() -> None:
    report = run_simulation(
        SimConfig(
            cp_size=3, seed=0, num_requests=40, batch_size=3, chunked_prefill_size=256, abort_prob=0.1,
            retract_prob=0.1, inflight_steps=2, hicache_ratio=1.25, baseline=False, timeout_s=120,
        )  # fmt: skip
    )
    _assert_promises(report, 3)
    assert report.prefill_chunks > 0 and report.aborted_requests > 0 and report.retracted_requests > 0
    assert report.host_evicted_tokens > 0 and report.host_hit_tokens > 0
    assert list(report.columns) == ["plugin", "native"]
    assert all(s.passed and s.world_size == 3 and s.kv_checked_tokens > 0 for s in report.columns.values())


def _write_rotation_race(path: Path) -> None:
    """Two new sessions on one uncached system prompt in one batch: the first chain's odd
    page count leaves the other class least full, so the second starts at another
    rotation base and its insert over the shared prefix is declined."""
    lines = [
        {"session_id": f"s{i}", "new_tokens": 150, "system_prompt": f"sys{i // 3}", "system_prompt_len": 256}
        for i in range(6)
    ]
    lines += [{"session_id": f"s{i}", "new_tokens": 50, "reply_tokens": 20} for i in range(6)]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n")


def test_rejected_inserts_and_the_hits_they_cost_are_counted(tmp_path: Path) -> None:
    trace = tmp_path / "race.jsonl"
    _write_rotation_race(trace)
    report = run_simulation(
        SimConfig(cp_size=2, trace_path=str(trace), batch_size=3, shard_impl="native", native_column=False)
    )
    _assert_promises(report, 2)
    native, upstream = report.columns["native"], report.columns["upstream"]
    assert native.rejected_inserts == report.rejected_inserts > 0
    assert native.rejected_insert_tokens > 0 and native.rejected_insert_hit_tokens > 0
    # Unsharded, there are no rotation runs to join.
    assert upstream.rejected_inserts == 0 and upstream.passed


# ------------------------------------------------------------------ planted bugs
@pytest.mark.parametrize(
    "fault, caught",
    [
        ("roll_load_owners", lambda r: r.kv_mismatches > 0 and any("break rotation base" in v for v in r.invariant_violations)),
        ("drop_last_rank_loads", lambda r: r.kv_mismatches > 0 and all(v.startswith("rank 1 ") for v in r.invariant_violations)),
        ("hot_path_barrier", lambda r: r.hot_path_collectives_by_name == {"barrier": 2 * r.requests}),
        ("diverge_last_rank", lambda r: len(set(r.radix_digests)) == 2 and any("diverged" in v for v in r.invariant_violations)),
        ("leak_tail", lambda r: r.leaked_device_slots > 0),
    ],
)  # fmt: skip
def test_a_planted_bug_fails_the_run(fault, caught) -> None:
    # Few requests for the leak: the run must reach its flush before the leak fills the pool.
    requests = 10 if fault == "leak_tail" else 20
    report = run_simulation(SimConfig(cp_size=2, seed=0, num_requests=requests, fault=fault, **NATIVE_ONLY))
    assert not report.passed and not report.columns["native"].passed
    assert caught(report), report.invariant_violations[:5]


def test_a_fault_in_a_comparison_column_fails_the_run() -> None:
    """Every invariant is checked for every column: a planted bug in the native column
    beside a plugin run fails the run too."""
    report = run_simulation(
        SimConfig(cp_size=2, seed=0, num_requests=12, fault="hot_path_barrier", baseline=False, timeout_s=120)
    )
    assert not report.columns["native"].passed and not report.passed
    assert any(v.startswith("native: ") for v in report.invariant_violations)


# ------------------------------------------------------------- what this line refuses
@pytest.mark.parametrize(
    "overrides, message",
    [
        (dict(mem_layout="page_first_direct"), "mem_layout must be one of"),
        (dict(io_backend="direct"), "io_backend must be 'kernel'"),
        (dict(fault="shift_mirror"), "fault .shift_mirror. is not planted on the SGLang 0.5.23 line"),
        (dict(cp_size=1), "cp_size must be >= 2"),
    ],
)
def test_the_line_refuses_what_it_cannot_run(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        run_simulation(SimConfig(**overrides))


def test_cli_shows_the_line_and_takes_the_shard_impl(capsys) -> None:
    parser, args = parse_args(["--shard-impl", "native", "--no-native-column", "--no-progress"])
    assert config_from_args(args) == SimConfig(shard_impl="native", native_column=False)
    assert config_from_args(parse_args(["--all-layer-backup", "--no-progress"])[1]).per_layer_backup is False
    parser.print_help()
    text = capsys.readouterr().out
    assert "SGLang 0.5.23" in text and "--shard-impl" in text and "(default: plugin)" in text
