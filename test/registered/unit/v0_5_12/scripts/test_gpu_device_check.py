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
    assert "bundle.py check .gpucheck" in out.stdout
    assert "plan: 2 processes, gloo CP group, device=cuda, SGLang kernels" in out.stdout


def test_cpu_mode_end_to_end_prints_pass_and_writes_json(tmp_path):
    """``device_check.sh --cpu``: spawned gloo ranks, reference kernels, one PASS line."""
    env = dict(os.environ, PYTHON=sys.executable, OUT=str(tmp_path))
    out = subprocess.run(["bash", str(SCRIPT), "--cpu"], capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    lines = out.stdout.strip().splitlines()
    assert out.returncode == 0, (out.stdout, out.stderr[-3000:])
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
