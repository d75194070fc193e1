"""End-to-end tests of the multi-rank CPU simulator: its promises hold, and its checkers fail
when a bug is planted (so a green run means something)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, parse_args
from sglang_cp_hicache.sim.config import FAULTS, SimConfig, WORKLOADS
from sglang_cp_hicache.sim.report.balance import max_over_mean
from sglang_cp_hicache.sim.report.records import SimReport
from sglang_cp_hicache.sim.results import OPS
from sglang_cp_hicache.sim.simulation import run_simulation
from sglang_cp_hicache.sim.v0_5_12.rank import LINE
from sglang_cp_hicache.sim.workload import generate_workload, load_trace, plan_steps, TraceError

REPO = Path(__file__).resolve().parents[4]

# cp 4 keeps the same logical capacity as cp 2 with half the pool per rank; the baseline
# (same physical pool, cp 1) is skipped there, so prompts only need to fit the CP pool.
CP4 = dict(
    physical_tokens=512,
    max_prompt_len=448,
    system_prompt_len=128,
    turn_len_min=32,
    turn_len_max=96,
    reply_len=32,
    baseline=False,
)


def _assert_promises(report: SimReport, cp_size: int) -> None:
    assert report.invariant_violations == []
    assert report.kv_mismatches == 0
    assert report.kv_checked_tokens == report.device_hit_tokens + report.host_hit_tokens
    assert len(report.radix_digests) == cp_size and len(set(report.radix_digests)) == 1
    assert len(set(report.decision_hashes)) == 1
    assert report.hot_path_collectives == 0
    assert all(n > 0 for n in report.writing_check_all_reduces)  # the allowed one did run
    assert report.leaked_device_slots == 0 and report.leaked_host_slots == 0
    # Both tiers were under pressure and the host tier served hits.
    assert report.host_hit_tokens > 0 and report.load_backs > 0
    assert report.device_evictions > 0 and report.host_evictions > 0
    # Shared KV: each rank stores and moves only its shard.
    assert all(0 < b < report.logical_host_bytes for b in report.host_bytes_per_rank)
    assert sum(report.d2h_bytes_per_rank) == report.replicated_d2h_bytes
    assert sum(report.h2d_bytes_per_rank) == report.replicated_h2d_bytes
    assert all(b < report.replicated_d2h_bytes for b in report.d2h_bytes_per_rank)
    assert set(report.op_time_us) == set(OPS)
    assert report.op_time_us["match_prefix"]["count"] == report.requests * cp_size
    _assert_balance_sane(report, cp_size)
    assert report.passed


def _assert_balance_sane(report: SimReport, cp_size: int) -> None:
    """Lane fill and per-rank skews are reported, consistent with the per-rank bytes."""
    b = report.balance
    page_bytes = report.config["page_size"] * report.bytes_per_token
    for lanes in (b.device_lane_peak_pages, b.device_lane_final_pages,
                  b.host_lane_peak_pages, b.host_lane_final_pages):  # fmt: skip
        assert len(lanes) == cp_size and min(lanes) >= 0
    assert all(peak >= final for peak, final in zip(b.host_lane_peak_pages, b.host_lane_final_pages))
    assert min(b.device_lane_peak_pages) > 0 and min(b.host_lane_peak_pages) > 0
    # Host lane r is rank r's physical host pool, sampled at the same points.
    assert [p * page_bytes for p in b.host_lane_peak_pages] == report.host_bytes_per_rank
    for name in ("device_lane_peak_skew", "device_lane_final_skew", "host_lane_peak_skew",
                 "host_lane_final_skew", "host_peak_bytes_skew", "d2h_bytes_skew",
                 "h2d_bytes_skew", "host_peak_bytes_vs_logical", "d2h_bytes_vs_logical",
                 "h2d_bytes_vs_logical"):  # fmt: skip
        assert 1.0 <= getattr(b, name) <= cp_size, name
    # Each logical page moves once, on its owner: the ranks' mean is logical / cp.
    assert b.d2h_bytes_skew == pytest.approx(b.d2h_bytes_vs_logical)
    assert b.d2h_bytes_skew == pytest.approx(max_over_mean(report.d2h_bytes_per_rank))


@pytest.fixture(scope="module")
def cp2_report() -> SimReport:
    return run_simulation(SimConfig(cp_size=2, seed=0, num_requests=60))


def test_cp2_end_to_end(cp2_report: SimReport) -> None:
    _assert_promises(cp2_report, 2)
    # The upstream replay ran on the same trace, verified its own hits, and is comparable.
    baseline = cp2_report.baseline
    assert baseline is not None and baseline.kv_mismatches == 0
    assert set(cp2_report.baseline_op_time_us) == set(cp2_report.op_time_us)
    # cp x the logical device pool for the same per-rank memory: more device hits.
    assert cp2_report.device_hit_tokens > baseline.device_hit_tokens


def test_cp4_end_to_end() -> None:
    report = run_simulation(SimConfig(cp_size=4, seed=1, num_requests=80, **CP4))
    _assert_promises(report, 4)
    assert report.baseline is None and report.baseline_op_time_us is None


def test_cp3_placement_is_balanced() -> None:
    """Balanced placement: no rank writes or holds much more than its share (within 1.10x
    the mean); placing new pages on lane 0 while it has room gives D2H 1.19x here."""
    report = run_simulation(SimConfig(cp_size=3, seed=1, num_requests=60, baseline=False))
    assert report.passed and report.config["workload"] == "default"
    assert report.balance.d2h_bytes_skew <= 1.10
    assert report.balance.host_peak_bytes_skew <= 1.10


def test_max_over_mean() -> None:
    assert max_over_mean([5, 5, 5]) == 1.0
    assert max_over_mean([0, 0]) == 1.0
    assert max_over_mean([3, 1, 1, 3]) == 1.5
    assert max_over_mean([4, 0, 0, 0]) == 4.0


def test_long_workload_preset() -> None:
    cfg = SimConfig.preset("long", cp_size=8, num_requests=120)
    assert cfg.workload == "long" and cfg.cp_size == 8 and cfg.num_requests == 120
    assert cfg.physical_tokens == 4096 and cfg.hicache_ratio == SimConfig().hicache_ratio
    assert SimConfig.preset("default") == SimConfig()
    requests = generate_workload(cfg)
    lengths = [len(r.token_ids) for r in requests]
    assert min(lengths) >= 1024 + 128 and 3500 <= max(lengths) <= 3840
    assert len(plan_steps(requests, cfg)) == len(requests)  # every prompt fits the pools
    with pytest.raises(ValueError, match="workload must be one of"):
        SimConfig.preset("huge")
    # l3, l3_large: the 0.5.23 line's storage runs
    assert set(WORKLOADS) == {"default", "long", "l3", "l3_large"}


def test_cli_workload_sets_defaults_and_flags_override() -> None:
    argv = ["--workload", "long", "--num-requests", "7", "--cp-size", "8", "--no-progress"]
    cfg = config_from_args(parse_args(argv)[1])
    assert cfg == SimConfig.preset("long", num_requests=7, cp_size=8)
    assert config_from_args(parse_args(["--no-progress"])[1]) == SimConfig()
    assert config_from_args(parse_args(["--draft", "--no-progress"])[1]) == SimConfig(draft=True)


# ------------------------------------------------------------------ planted bugs
def _faulty(fault: str, **overrides) -> SimReport:
    cfg = dict(cp_size=2, seed=0, num_requests=40, baseline=False, fault=fault, timeout_s=60)
    cfg.update(overrides)
    return run_simulation(SimConfig(**cfg))


@pytest.mark.parametrize("fault", ["roll_load_owners", "drop_last_rank_loads"])
def test_wrong_load_back_is_caught(fault: str) -> None:
    report = _faulty(fault)
    assert report.kv_mismatches > 0
    assert not report.passed
    assert any("wrong KV/indexer bytes" in v for v in report.invariant_violations)


def test_wrong_node_runs_are_caught() -> None:
    report = _faulty("shift_mirror", num_requests=1)
    assert not report.passed
    assert any("host locs" in v for v in report.invariant_violations)


def test_drop_on_one_rank_is_seen_only_there() -> None:
    report = _faulty("drop_last_rank_loads")
    assert all(v.startswith("rank 1 ") for v in report.invariant_violations)


def test_hot_path_collective_is_counted() -> None:
    report = _faulty("hot_path_barrier", num_requests=10)
    assert report.hot_path_collectives_by_name == {"barrier": 2 * 10}
    assert report.kv_mismatches == 0 and not report.passed


def test_rank_divergence_is_caught_without_hanging() -> None:
    report = _faulty("diverge_last_rank", num_requests=20)
    assert len(set(report.radix_digests)) == 2
    assert any("diverged" in v for v in report.invariant_violations)
    assert not report.passed


def test_leak_is_caught() -> None:
    report = _faulty("leak_tail", num_requests=10)
    assert report.leaked_device_slots > 0
    assert not report.passed


def test_draft_only_loss_is_a_draft_mismatch_not_a_hit() -> None:
    """The last rank's load-backs restore the target's KV but not the MTP draft's: every
    target byte checks out, and the hits are still reported as draft mismatches (FAIL)."""
    report = _faulty("drop_last_rank_draft_loads", draft=True)
    assert report.draft and report.kv_mismatches == 0
    assert report.draft_kv_mismatches > 0 and not report.passed
    assert report.draft_kv_checked_tokens == report.kv_checked_tokens > 0
    assert all(v.startswith("rank 1 ") and "wrong draft KV/indexer bytes" in v for v in report.invariant_violations)
    with pytest.raises(ValueError, match="needs draft=True"):
        SimConfig(fault="drop_last_rank_draft_loads")


def test_native_sharding_is_refused_on_this_line(cp2_report: SimReport) -> None:
    """0.5.12.post1 ships no KV sharding: a native main column is refused before any rank
    starts, and a plugin run's native column reads n/a, saying why."""
    with pytest.raises(ValueError, match="has no native KV sharding"):
        run_simulation(SimConfig(shard_impl="native"))
    assert cp2_report.sglang_release == "0.5.12.post1"
    assert list(cp2_report.columns) == ["plugin", "upstream"]
    assert "no native KV sharding" in cp2_report.native_column_note
    assert cp2_report.columns["plugin"].rejected_insert_tokens == 0 and cp2_report.columns["plugin"].passed


def test_every_fault_has_a_test() -> None:
    tested = {"roll_load_owners", "drop_last_rank_loads", "hot_path_barrier"}
    tested |= {"diverge_last_rank", "leak_tail", "shift_mirror", "drop_last_rank_draft_loads"}
    tested |= {"pd_wrong_owner"}  # test_simulator_pd.py
    assert set(LINE.faults) == tested
    # 0.5.23 only: test_simulator_per_layer.py, test_simulator_storage.py, test_simulator_pd.py
    assert set(FAULTS) == tested | {"early_layer_ack", "skip_backup_layer", "early_l3_write", "storage_wrong_bytes", "pd_drop_draft"}


@pytest.mark.parametrize(
    "fault, needs",
    [("early_layer_ack", {}), ("skip_backup_layer", {}), ("storage_wrong_bytes", {"storage_backend": "file"}),
     ("early_l3_write", {"storage_backend": "file"})],
)
def test_a_fault_this_line_does_not_plant_is_refused(fault, needs) -> None:
    """A fault planted only on the 0.5.23 line would replay clean here (a checker test
    that cannot fail): it is refused before any rank starts."""
    with pytest.raises(ValueError, match=f"fault '{fault}' is not planted on the SGLang 0.5.12.post1 line"):
        run_simulation(SimConfig(fault=fault, baseline=False, **needs))


@pytest.mark.parametrize("cp_size", [2, 3])
def test_draft_kv_travels_with_the_target_and_is_checked_on_every_hit(cp_size) -> None:
    """The MTP draft's 1-layer pool beside the target's: per-layer backups ack after the
    draft's layer, chunks, aborts, retractions and acks in flight; every hit token's target
    and draft bytes are checked by its owner, draft bytes move only on the owner."""
    report = run_simulation(
        SimConfig(
            cp_size=cp_size, seed=0, num_requests=60, batch_size=2, chunked_prefill_size=256,
            abort_prob=0.1, retract_prob=0.1, inflight_steps=2, baseline=False, draft=True,
        )  # fmt: skip
    )
    assert report.invariant_violations == [] and report.passed
    assert report.draft and report.draft_kv_mismatches == 0 and report.kv_mismatches == 0
    hits = report.device_hit_tokens + report.host_hit_tokens
    assert report.draft_kv_checked_tokens == report.kv_checked_tokens == hits
    assert report.host_hit_tokens > 0 and report.host_evictions > 0 and report.pending_committed > 0
    assert report.leaked_host_slots == 0 and report.hot_path_collectives == 0
    # The draft's bytes: one layer of (KV + indexer) per token, in the target's slots.
    layers = report.config["layer_num"]
    assert report.draft_bytes_per_token * layers == report.bytes_per_token
    draft_bpt, bpt = report.draft_bytes_per_token, report.bytes_per_token
    for draft, target in (
        (report.draft_d2h_bytes_per_rank, report.d2h_bytes_per_rank),
        (report.draft_h2d_bytes_per_rank, report.h2d_bytes_per_rank),
        (report.draft_host_bytes_per_rank, report.host_bytes_per_rank),
    ):
        assert len(draft) == cp_size and all(d * bpt == t * draft_bpt for d, t in zip(draft, target)), (draft, target)
    assert all(b > 0 for b in report.draft_host_bytes_per_rank)


# ------------------------------------------------------------------------ traces
def _write_trace(path: Path) -> None:
    lines = [
        {"session_id": "a", "new_tokens": 100, "system_prompt": "sys", "system_prompt_len": 192},
        {"session_id": "b", "new_tokens": 70, "system_prompt": "sys"},
        {"session_id": "a", "new_tokens": 90, "reply_tokens": 40},
        {"session_id": 7, "token_ids": list(range(1000, 1300))},
        {"session_id": "b", "new_tokens": 64, "reply_tokens": 30},
        {"session_id": 7, "token_ids": list(range(1000, 1300)) + list(range(5, 105))},
        {"session_id": "a", "new_tokens": 50, "reply_tokens": 40},
    ]
    path.write_text("\n".join(json.dumps(line) for line in lines) + "\n\n")


def test_jsonl_trace_replay(tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    _write_trace(trace)
    requests = load_trace(str(trace))
    assert [r.session_id for r in requests] == ["a", "b", "a", "7", "b", "7", "a"]
    assert requests[0].token_ids[:192] == requests[1].token_ids[:192]  # shared system prompt
    assert requests[2].token_ids[: len(requests[0].token_ids)] == requests[0].token_ids
    assert len(requests[2].token_ids) == 192 + 100 + 40 + 90

    report = run_simulation(SimConfig(cp_size=2, trace_path=str(trace), baseline=True))
    assert report.requests == 7 and report.passed
    # Session continuations and the shared system prompt hit on device.
    assert report.device_hit_tokens >= 192 + 256 + 256


@pytest.mark.parametrize(
    "line, message",
    [
        ("not json", "not JSON"),
        ('{"token_ids": [1, 2]}', "session_id"),
        ('{"session_id": 1}', "needs 'token_ids' or 'new_tokens'"),
        ('{"session_id": 1, "new_tokens": -3}', "non-negative integer"),
        ('{"session_id": 1, "new_tokens": 9, "system_prompt": "s"}', "needs 'system_prompt_len'"),
        ('{"session_id": 1, "token_ids": [1]}', "at least 2 tokens"),
    ],
)
def test_bad_trace_lines_name_the_line(tmp_path: Path, line: str, message: str) -> None:
    trace = tmp_path / "bad.jsonl"
    trace.write_text('{"session_id": 0, "token_ids": [1, 2, 3]}\n' + line + "\n")
    with pytest.raises(TraceError, match=message) as info:
        load_trace(str(trace))
    assert f"{trace}:2" in str(info.value)


def test_generator_is_seeded_and_reuses_prefixes() -> None:
    cfg = SimConfig(num_requests=50)
    first, again = generate_workload(cfg), generate_workload(cfg)
    assert first == again
    assert generate_workload(SimConfig(num_requests=50, seed=1)) != first
    assert all(2 <= len(r.token_ids) <= cfg.max_prompt_len for r in first)
    assert len({r.session_id for r in first}) < len(first)  # multi-turn sessions


def test_request_too_long_for_the_pool_is_rejected_early() -> None:
    cfg = SimConfig(num_requests=5, max_prompt_len=4096, turn_len_min=3000, turn_len_max=3000)
    with pytest.raises(ValueError, match="raise physical_tokens"):
        plan_steps(generate_workload(cfg), cfg)


# --------------------------------------------------------------------------- CLI
def test_cli_json(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = dict(os.environ, PYTHONPATH=str(REPO / "python"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_cp_hicache.sim", "--cp-size", "2", "--num-requests", "20",
         "--no-baseline", "--no-progress", "--json", str(out)],
        capture_output=True, text=True, env=env, cwd=tmp_path, timeout=240,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "result: PASS" in proc.stdout
    data = json.loads(out.read_text())
    assert data["passed"] is True
    for key in (
        "kv_mismatches", "invariant_violations", "radix_digests", "hot_path_collectives",
        "leaked_device_slots", "leaked_host_slots", "device_hit_tokens", "host_hit_tokens",
        "logical_host_bytes", "host_bytes_per_rank", "d2h_bytes_per_rank", "h2d_bytes_per_rank",
        "replicated_d2h_bytes", "replicated_h2d_bytes", "op_time_us", "baseline_op_time_us",
        "balance",
    ):  # fmt: skip
        assert key in data, key
    assert data["requests"] == 20 and len(data["radix_digests"]) == 2
    assert data["config"]["cp_size"] == 2 and data["config"]["workload"] == "default"
    assert len(data["balance"]["host_lane_peak_pages"]) == 2
    assert data["balance"]["d2h_bytes_skew"] >= 1.0
    assert "max-rank / mean:" in proc.stdout and "owner lane fill" in proc.stdout


def test_cli_plot_without_matplotlib_fails_clearly(capsys, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import now raises ImportError
    from sglang_cp_hicache.sim.cli import main

    with pytest.raises(SystemExit) as info:
        main(["--plot", "x.png", "--no-progress"])
    assert info.value.code == 2
    assert "needs matplotlib" in capsys.readouterr().err


def test_plot_is_written(cp2_report: SimReport, tmp_path: Path) -> None:
    from sglang_cp_hicache.sim.plot import write_plot

    path = tmp_path / "sim.png"
    write_plot(cp2_report, str(path))
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_lanes_held_by_the_batch_do_not_crash_prefill():
    """Regression: at cp 4 with two requests a batch, short extends used to pile new pages
    onto lane 0 while the batch itself held that lane; prefill must never raise OOM while
    the lanes together have room."""
    report = run_simulation(
        SimConfig(
            cp_size=4, batch_size=2, seed=7, hicache_ratio=3.0,
            num_requests=150, baseline=False, physical_tokens=512, max_prompt_len=448,
            system_prompt_len=128, turn_len_min=32, turn_len_max=96, reply_len=32,
        )
    )
    assert report.passed and report.kv_mismatches == 0 and not report.invariant_violations


@pytest.mark.parametrize("cp_size", [2, 3])
def test_pending_backups_hold_every_promise_with_chunking_aborts_and_transfers_in_flight(cp_size) -> None:
    """Write acks land two steps after submission, prompts run in 256-token chunks, some
    requests are aborted or retracted, host and device under pressure."""
    report = run_simulation(
        SimConfig(
            cp_size=cp_size, seed=0, num_requests=60, batch_size=2, chunked_prefill_size=256,
            abort_prob=0.1, retract_prob=0.1, inflight_steps=2, hicache_ratio=1.25, baseline=False,
        )  # fmt: skip
    )
    assert report.invariant_violations == [] and report.passed
    assert report.kv_mismatches == 0 and report.kv_checked_tokens > 0
    assert len(set(report.decision_hashes)) == 1 and report.hot_path_collectives == 0
    assert report.leaked_device_slots == 0 and report.leaked_host_slots == 0
    assert report.prefill_chunks > 0 and report.aborted_requests > 0 and report.retracted_requests > 0
    # Retractions (and insert misses of the batch) roll back reservations made before the forward.
    assert report.pending_committed > 0 and report.pending_rolled_back > 0
    assert report.host_hit_tokens > 0 and report.host_evictions > 0
    # A request met a pending backup it would split and waited (no lock leak: passed).
    assert report.deferred_splits > 0 and report.deferred_requests > 0


def test_admission_waits_for_a_free_request_slot() -> None:
    """Deferred, re-queued and new requests together can outnumber the free request
    slots; upstream admits no more than it has slots for (they wait), never a batch whose
    alloc_req_slots fails."""
    report = run_simulation(
        SimConfig(
            cp_size=3, seed=0, num_requests=160, batch_size=4, chunked_prefill_size=256,
            abort_prob=0.05, retract_prob=0.05, inflight_steps=4, hicache_ratio=1.2, baseline=False,
        )  # fmt: skip
    )
    assert report.invariant_violations == [] and report.passed
    assert report.deferred_splits > 0 and report.backups_skipped_host_full > 0
