"""The simulator report's per-op table and its plugin-vs-native section: the plugin's times
are compared with the native column of the same run (not only with cp-1 upstream), and the
section names what moved between those two columns."""

from types import SimpleNamespace

from sglang_cp_hicache.sim.report.table import delta_rows, op_rows


def _stats(p50: float, p99: float, count: int = 4) -> dict:
    return {"count": count, "p50": p50, "p99": p99, "mean": p50}


def _cells(table: list, op: str) -> list:
    return next(line.split() for line in table if line.startswith(op))


def test_each_ratio_divides_by_its_own_columns_p50() -> None:
    # Distinct p50s per column, so a ratio against the wrong column reads another number.
    report = SimpleNamespace(
        config={"shard_impl": "plugin"},
        op_time_us={"insert": _stats(30.0, 90.0), "evict": _stats(8.0, 9.0, count=0)},
        native_op_time_us={"insert": _stats(20.0, 40.0), "evict": _stats(4.0, 5.0)},
        baseline_op_time_us={"insert": _stats(10.0, 11.0), "evict": _stats(2.0, 3.0)},
    )
    table = op_rows(report)
    assert table[1].split() == [
        "op", "n", "plugin", "p50", "p99", "native", "p50", "p99", "plugin/native",
        "upstream", "p50", "p99", "plugin/upstream",
    ]  # fmt: skip
    assert _cells(table, "insert") == ["insert", "4", "30.0", "90.0", "20.0", "40.0", "1.50x", "10.0", "11.0", "3.00x"]
    # An op the main column never ran has no ratio, whatever the others did.
    assert _cells(table, "evict")[6] == "-" and _cells(table, "evict")[9] == "-"


def test_a_native_main_column_is_compared_with_upstream_only() -> None:
    report = SimpleNamespace(
        config={"shard_impl": "native"},
        op_time_us={"insert": _stats(30.0, 90.0)},
        native_op_time_us=None,
        baseline_op_time_us={"insert": _stats(10.0, 11.0)},
    )
    table = op_rows(report)
    assert "native/upstream" in table[1] and "plugin" not in table[1]
    assert _cells(table, "insert") == ["insert", "4", "30.0", "90.0", "10.0", "11.0", "3.00x"]


def _column(**overrides) -> SimpleNamespace:
    figures = dict(
        device_hit_tokens=1000, host_hit_tokens=200, hit_rate=0.6, device_evicted_tokens=5000,
        device_lane_peak_skew=1.0, backups_skipped_host_full=0, host_evicted_tokens=3000,
        rejected_inserts=0, rejected_insert_tokens=0, rejected_insert_hit_tokens=0,
    )  # fmt: skip
    return SimpleNamespace(**{**figures, **overrides})


def test_the_section_names_the_run_and_what_moved_between_plugin_and_native() -> None:
    report = SimpleNamespace(
        config={"workload": "long", "cp_size": 4, "batch_size": 1, "seed": 3, "storage_backend": None},
        columns={
            "plugin": _column(device_evicted_tokens=4500, host_hit_tokens=264),
            "native": _column(backups_skipped_host_full=2),
        },
        op_time_us={"insert": _stats(30.0, 90.0), "alloc": _stats(7.0, 8.0), "evict": _stats(11.0, 12.0)},
        native_op_time_us={"insert": _stats(40.0, 50.0), "alloc": _stats(5.0, 6.0), "evict": _stats(10.0, 99.0)},
        per_layer_forwards=0,
    )
    lines = delta_rows(report)
    assert "workload long, cp 4, batch size 1, seed 3" in lines[0]
    text = "\n".join(lines)
    assert "hit tokens 1264 vs 1200 (+64, +5.3 %)" in text
    assert "device evicted tokens 4500 vs 5000 (-500, -10.0 %)" in text
    assert "backups skipped for want of host room 0 vs 2" in text
    assert "try --batch-size 4" in text  # the rotation-run delta cannot act at batch size 1
    # Per op against native's p50 (evict's 1.10x is inside the band; native's p99 is no p50).
    assert "beyond 1.15x of native's either way: insert 0.75x, alloc 1.40x (" in text
    assert lines[-1].startswith(
        "  on this run they show in: hits, lane-aware device eviction, lane-aware host room, scheduler time;"
    )
