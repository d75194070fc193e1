"""scripts/gpu_check_shared_kv.sh: --dry-run, and the same driver on CPU (torch reference)."""

import importlib.util
import subprocess
import sys
from pathlib import Path

from sglang_cp_hicache.testing.dist import run_ranks

ROOT = Path(__file__).resolve().parents[4]
SCRIPT = ROOT / "scripts" / "gpu_check_shared_kv.sh"


def _driver():
    spec = importlib.util.spec_from_file_location("gpu_check_shared_kv", ROOT / "scripts" / "gpu_check_shared_kv.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_dry_run_prints_the_plan_and_runs_nothing():
    out = subprocess.run(
        ["bash", str(SCRIPT), "--dry-run"], capture_output=True, text=True, timeout=60,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    assert "install" in out.stdout and "check: timeout 150" in out.stdout
    assert "plan: 2 processes, gloo CP group, device=cuda" in out.stdout


def test_cpu_mode_runs_the_driver_with_the_torch_reference(capsys):
    driver = _driver()
    rc = driver.main(
        ["--device", "cpu", "--cp", "2"],
        launch=lambda world, fn, options: run_ranks(world, fn, options, timeout_s=60),
    )
    lines = capsys.readouterr().out.strip().splitlines()
    assert rc == 0, lines
    assert lines[0].startswith("PASS shared-KV == replicated (cp=2 device=cpu")
    assert lines[1].startswith("timings: all_reduce/prefetch=0")


def test_a_mismatch_is_reported_as_one_fail_line():
    driver = _driver()
    options = driver.CheckOptions("cpu", 2, 10.0)
    good = {"strategy": "all_reduce", "prefetch": False, "identical": True, "max_abs_diff": 0.0,
            "pool_problems": (), "seconds": 0.1}
    bad = dict(good, identical=False, max_abs_diff=0.5)
    ok, lines = driver.summarize([{"pool": "p", "results": [good]}, {"pool": "p", "results": [bad]}], options, 1.0)
    assert not ok and lines[0].startswith("FAIL") and "rank 1" in lines[0]
