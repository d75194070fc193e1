"""scripts/gpu/device_check.sh: --dry-run, --cpu end to end, and the driver's summary."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

from sglang_cp_hicache.testing.dist import run_ranks

ROOT = Path(__file__).resolve().parents[5]
SCRIPT = ROOT / "scripts" / "gpu" / "device_check.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_device_check", ROOT / "scripts" / "gpu" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_offline_install_and_the_checks():
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "--no-index --no-deps" in out.stdout and "--target" in out.stdout
    assert "bundle.py check --line 0.5.12.post1 .gpucheck" in out.stdout
    assert "plan: 2 processes, gloo CP group, device=cuda, SGLang kernels" in out.stdout


def test_cpu_mode_end_to_end_prints_pass_and_writes_json(tmp_path):
    """``device_check.sh --cpu``: spawned gloo ranks, reference kernels, one PASS line."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path), TMPDIR=str(scratch))
    out = subprocess.run(["bash", str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:])
    assert not list(scratch.glob("gpucheck-site.*")), "--cpu installs nothing: no install dir left behind"
    assert lines[0].startswith("PASS shared-KV == replicated (cp=2 device=cpu"), lines
    assert "4 self-tests" in lines[0]
    report = json.loads((tmp_path / "device_check.json").read_text())
    assert report["ok"] is True
    assert report["bandwidth"]["d2h_gbps"] > 0 and report["bandwidth"]["peak_h2d_gbps"] > 0
    assert report["hicache_jit"]["ran"] is False
    assert report["per_layer_backup"]["ok"] is True
    assert {k for k in report["per_layer_backup"] if "/" in k} == {
        "kernel/layer_first", "direct/layer_first", "direct/page_first_direct"
    }
    assert any(line.startswith("per-layer backup") and "byte-exact=True" in line for line in lines)
    pipeline = report["per_layer_pipeline"]
    assert pipeline["ok"] is True
    assert {k: v for k, v in pipeline.items() if "/" in k} == {
        "kernel/layer_first": {"problems": [], "overlap_ms": [None, None], "raised": False},
        "direct/page_first_direct": {"problems": [], "overlap_ms": [None, None], "raised": False},
    }  # no negative control on CPU: its copies are synchronous, a missing wait races nothing
    assert lines[-2] == (
        "per-layer pipeline (CP stack, write/load streams, acks, load-back byte-exact): "
        "kernel/layer_first ok; direct/page_first_direct ok"
    )
    for rank in report["ranks"]:
        assert [(e["kv"], e["strategy"], e["ok"]) for e in rank["selftest"]] == [
            ("bf16", "all_reduce", True), ("bf16", "all_gather", True),
            ("fp8", "all_reduce", True), ("fp8", "all_gather", True),
        ]


def test_a_selftest_failure_or_twin_mismatch_is_one_fail_line():
    driver = _driver()
    options = driver.CheckOptions("cpu", 2, 10.0)
    good = {"strategy": "all_reduce", "prefetch": False, "identical": True, "max_abs_diff": 0.0,
            "pool_problems": (), "seconds": 0.1}
    passing = {"kv": "bf16", "strategy": "all_reduce", "ok": True, "stages": [], "seconds": 0.2}
    failing = {"kv": "fp8", "strategy": "all_gather", "ok": False, "stage": "topk_transform", "error": "x"}
    ok, lines = driver.summarize(
        [{"pool": "p", "results": [good], "selftest": [passing]}, {"pool": "p", "results": [good], "selftest": [failing]}],
        options, 1.0,
    )
    assert not ok and lines[0].startswith("FAIL") and "rank 1 self-test fp8/all_gather stage topk_transform" in lines[0]
    bad = dict(good, identical=False, max_abs_diff=0.5)
    ok, lines = driver.summarize([{"pool": "p", "results": [good]}, {"pool": "p", "results": [bad]}], options, 1.0)
    assert not ok and lines[0].startswith("FAIL") and "rank 1" in lines[0]
    bad_draft = dict(good, draft_identical=False, draft_max_abs_diff=0.5)
    ok, lines = driver.summarize([{"pool": "p", "results": [bad_draft]}], options, 1.0)
    assert not ok and "rank 0" in lines[0] and "draft max" in lines[0]
    draft_pool = dict(good, draft_identical=True, draft_max_abs_diff=0.0, draft_pool_problems=("layer 0: x",))
    ok, lines = driver.summarize([{"pool": "p", "results": [draft_pool]}], options, 1.0)
    assert not ok and "draft layer 0: x" in lines[0]
    ok, lines = driver.summarize(
        [{"pool": "p", "results": [good], "selftest": [passing]}], options, 1.0,
        {"hicache_jit": {"ran": True, "ok": False}},
    )
    assert not ok and "hicache JIT" in lines[0]
    ok, lines = driver.summarize(
        [{"pool": "p", "results": [good], "selftest": [passing]}], options, 1.0,
        {"per_layer_backup": {"ran": True, "ok": False, "direct/layer_first": {"exact": False, "layer_shard_gbps": 1.0}}},
    )
    assert not ok and "per-layer HiCache backup differs" in lines[0]


def test_a_crashed_rank_still_runs_and_reports_the_main_process_checks(tmp_path, monkeypatch, capsys):
    """The device call is one shot: a rank that raises must not cost the bandwidth, JIT and
    per-layer backup figures; the result is still one FAIL line naming the rank's error."""
    driver = _driver()
    monkeypatch.setenv("GPU_CHECK_JSON", str(tmp_path / "report.json"))
    ran = []

    def crashed(world, fn, options):
        raise RuntimeError("rank 1 failed:\nTraceback ...\nValueError: kernel refused")

    def checks(options):
        ran.append(options.device)
        return {"bandwidth": {"ran": False, "ok": False, "error": "OSError: no pinned memory"}}

    monkeypatch.setattr(driver, "main_process_checks", checks)
    assert driver.main(["--device", "cpu"], launch=crashed) == 1
    lines = capsys.readouterr().out.strip().splitlines()
    assert ran == ["cpu"]
    assert lines[0] == "FAIL RuntimeError: ValueError: kernel refused"
    assert "bandwidth raised: OSError: no pinned memory" in lines
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False and report["ranks"] is None
    assert report["bandwidth"]["error"] == "OSError: no pinned memory"


def test_a_main_process_check_that_raises_is_a_failure_and_the_others_still_run(monkeypatch):
    driver = _driver()

    def jit_build_failed(device):
        raise RuntimeError("nvcc: not found")

    monkeypatch.setattr(driver, "hicache_jit_transfer", jit_build_failed)
    bandwidth = {
        "layer_shard_bytes": 1e6, "prefix_tokens": 16384, "cp": 8, "d2h_gbps": 20.0, "d2h_of_peak": 0.8,
        "peak_d2h_gbps": 25.0, "h2d_gbps": 20.0, "h2d_of_peak": 0.8, "peak_h2d_gbps": 25.0,
    }
    monkeypatch.setattr(driver, "shard_bandwidth", lambda device, shard: dict(bandwidth, prefix_tokens=shard.prefix_tokens))
    monkeypatch.setattr(driver, "per_layer_backup", lambda device, shard: {"ran": True, "ok": True})
    extra = driver.main_process_checks(driver.CheckOptions("cpu", 2, 10.0))
    assert extra["hicache_jit"] == {"ran": False, "ok": False, "error": "RuntimeError: nvcc: not found"}
    assert extra["bandwidth"] == bandwidth
    assert extra["per_layer_backup"] == {"ran": True, "ok": True}
    good = {"strategy": "all_reduce", "prefetch": False, "identical": True, "max_abs_diff": 0.0,
            "pool_problems": (), "seconds": 0.1}
    ok, lines = driver.summarize([{"pool": "p", "results": [good]}], driver.CheckOptions("cpu", 2, 10.0), 1.0, extra)
    assert not ok and lines[0].startswith("FAIL") and "hicache_jit raised: RuntimeError: nvcc: not found" in lines[0]
    assert any(line.startswith("owned shard per layer (1.0 MB, prefix 16384, cp 8)") for line in lines), lines


def test_one_layout_that_raises_keeps_the_other_layouts_figures(monkeypatch):
    """The per-layer check on the CPU runtime: a layout whose transfer raises is reported
    with its error and fails the check; the others keep their byte check and figures."""
    driver = _driver()
    from sglang_cp_hicache.testing import install

    install()
    import torch

    real = driver._per_layer_against_all_layer

    def page_first_breaks(pool, device, layers, shard, layout, io_backend, *rest):
        if layout == "page_first_direct":
            raise RuntimeError("cudaMemcpyBatchAsync failed")
        return real(pool, device, layers, shard, layout, io_backend, *rest)

    monkeypatch.setattr(driver, "_per_layer_against_all_layer", page_first_breaks)
    report = driver.per_layer_backup(torch.device("cpu"), driver.ShardGeometry(prefix_tokens=4096), repeats=1)
    assert report["ok"] is False
    assert report["direct/page_first_direct"] == {"exact": False, "error": "RuntimeError: cudaMemcpyBatchAsync failed"}
    assert report["kernel/layer_first"]["exact"] and report["direct/layer_first"]["exact"]
    # SGLang never unregisters a pinned host pool: the check keeps each one it made alive
    # (two NSA pool pairs per layout that ran), so no freed range is registered twice.
    assert [type(pool).__name__ for pair in driver.LIVE_HOST_POOLS for pool in pair] == [
        "MLATokenToKVPoolHost", "NSAIndexerPoolHost"
    ] * 4
    lines = driver.summarize_main_process({"per_layer_backup": report})
    assert "direct/page_first_direct raised RuntimeError: cudaMemcpyBatchAsync failed" in lines[-1]
    assert "kernel/layer_first" in lines[-1] and "GB/s" in lines[-1]


def test_a_pipeline_breach_fails_the_check_and_the_overlap_is_reported():
    """The pipeline's verdict is ``round_trip_problems`` per layout: a rank's error or a
    breach fails the check naming the layout; on CUDA each rank's overlap is printed."""
    driver = _driver()
    options = driver.CheckOptions("cuda", 2, 10.0)
    good = {"acks_before_last": [[13]], "acks": [[13], [11, 12]], "overlap_ms": 4.0,
            "loaded": {11: [0, 0, 0, 64], 12: [0, 0, 0, 0], 13: [0, 0, 0, 64]}}
    last = dict(good, overlap_ms=3.5, loaded={11: [0, 0, 0, 64], 12: [0, 0, 0, 128], 13: [0, 0, 0, 128]})
    stale = dict(last, loaded={**last["loaded"], 12: [0, 128, 0, 128]})

    def launch(world, fn, plain):
        assert fn is driver.pipeline_rank and plain["timeout_s"] == 10.0
        return [[{"report": good}, {"error": "RuntimeError: boom"}], [{"report": last}, {"report": stale}]]

    pipeline = driver.per_layer_pipeline(options, launch)
    assert pipeline["ok"] is False
    assert pipeline["kernel/layer_first"] == {"problems": [], "overlap_ms": [4.0, 3.5], "raised": False}
    assert pipeline["direct/page_first_direct"]["problems"] == ["rank 0: RuntimeError: boom"]
    assert driver.main_process_failures({"per_layer_pipeline": pipeline}) == [
        "per-layer pipeline direct/page_first_direct: rank 0: RuntimeError: boom"
    ]
    line = driver.summarize_main_process({"per_layer_pipeline": pipeline})[-1]
    assert "kernel/layer_first ok, layer 0 on host 3.50-4.00 ms before the last layer's stores" in line
    assert "direct/page_first_direct FAILED" in line

    def breach(world, fn, plain):
        return [[{"report": good}, {"report": good}], [{"report": last}, {"report": stale}]]

    pipeline = driver.per_layer_pipeline(options, breach)
    assert pipeline["direct/page_first_direct"]["problems"] == [
        "rank 1 node 12: mismatched tokens per layer [0, 128, 0]"
    ]

    def hung(world, fn, plain):
        raise RuntimeError("rank 1 failed:\nTimeoutError: no answer in 90 s")

    assert driver.per_layer_pipeline(options, hung) == {
        "ran": False, "ok": False, "error": "RuntimeError: TimeoutError: no answer in 90 s"
    }


def test_the_negative_control_must_be_caught_by_stale_bytes():
    """On CUDA the ranks also run the round trip with the layer-stored wait removed: the
    check passes only if that run's load-back shows stale bytes; a clean run, a crash or
    another breach fails it."""
    driver = _driver()
    options = driver.CheckOptions("cuda", 2, 10.0)
    good = {"acks_before_last": [[13]], "acks": [[13], [11, 12]], "overlap_ms": 4.0,
            "loaded": {11: [0, 0, 0, 64], 12: [0, 0, 0, 0], 13: [0, 0, 0, 64]}}
    last = dict(good, loaded={11: [0, 0, 0, 64], 12: [0, 0, 0, 128], 13: [0, 0, 0, 128]})
    stale = dict(last, loaded={**last["loaded"], 11: [0, 64, 64, 64]})

    def run(control_0, control_1):
        ranks = [[{"report": good}] * 2 + [control_0], [{"report": last}] * 2 + [control_1]]
        return driver.per_layer_pipeline(options, lambda world, fn, plain: ranks)

    caught = run({"report": good}, {"report": stale})
    assert caught["ok"] is True and caught["negative_control"]["detected"] is True
    assert driver.main_process_failures({"per_layer_pipeline": caught}) == []
    assert driver.summarize_main_process({"per_layer_pipeline": caught})[-1].endswith(
        "negative control (no wait for a layer's stores): caught, 1 stale node loads"
    )
    for missed in (run({"report": good}, {"report": last}), run({"error": "E: x"}, {"report": stale}),
                   run({"report": dict(good, acks=[[11, 12], [13]])}, {"report": last})):
        assert missed["ok"] is False and missed["negative_control"]["detected"] is False
        (failure,) = driver.main_process_failures({"per_layer_pipeline": missed})
        assert failure.startswith("per-layer pipeline negative control: a write stream that does not wait")


def test_the_planted_fault_removes_only_the_wait():
    """``_layer_wait_removed`` hands out events that record and answer as before but never
    make a stream wait, and restores ``ControllerLayerTransfers.new_event`` after."""
    driver = _driver()
    from sglang_cp_hicache.testing import install

    install()
    from sglang_cp_hicache.v0_5_12.mem_cache.hybrid_cache.cp_hybrid_cache_controller import (
        ControllerLayerTransfers,
    )

    original = ControllerLayerTransfers.new_event
    waited = []

    class Event:
        def record(self):
            waited.append("record")

        def wait(self, stream):
            waited.append("wait")

        def query(self):
            return True

    ControllerLayerTransfers.new_event = lambda self: Event()
    try:
        with driver._layer_wait_removed():
            event = ControllerLayerTransfers.new_event(None)
            event.record()
            event.wait("write stream")
            assert event.query() is True
        assert waited == ["record"]
        assert isinstance(ControllerLayerTransfers.new_event(None), Event)
    finally:
        ControllerLayerTransfers.new_event = original
