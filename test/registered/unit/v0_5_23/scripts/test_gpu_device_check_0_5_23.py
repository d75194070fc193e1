"""scripts/gpu/device_check.sh --sglang 0.5.23: the shell's line switch and dry run, the driver's
one PASS/FAIL line naming the stage, and its JSON report.

The ranks' own work (``check_rank_0_5_23``: the self-test and the read-path twin per admitted
format) runs inside ``test/registered/multi_rank/v0_5_23/test_kv_shard_selftest_multi_rank.py``,
so this file spawns no ranks and stays fast.
"""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]
SCRIPT = ROOT / "scripts" / "gpu" / "device_check.sh"
ENV = {"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("gpu_device_check", ROOT / "scripts" / "gpu" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _sh(*args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60, env=ENV, cwd=ROOT)


@pytest.mark.parametrize("spelling", [("--sglang", "0.5.23"), ("--sglang=0.5.23",)])
def test_cpu_dry_run_plans_the_selftest_and_twin_for_both_formats(spelling):
    out = _sh("--cpu", *spelling, "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "install: none" in out.stdout and "--sglang 0.5.23 --device cpu --cp 2" in out.stdout
    assert "plan (sglang 0.5.23): 2 processes, gloo CP group, device=cpu" in out.stdout
    assert "'flashmla_sparse/bfloat16', 'flashmla_kv/fp8_e4m3'" in out.stdout
    assert "bundle.py" not in out.stdout


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)])
def test_0_5_23_without_cpu_refuses_naming_why(dry_run):
    out = _sh("--sglang", "0.5.23", *dry_run)
    assert out.returncode == 2
    assert out.stdout.startswith("FAIL --sglang 0.5.23 runs with --cpu only") and "torch 2.11" in out.stdout


def test_the_default_stays_the_0_5_12_prepared_check():
    default, explicit = _sh("--dry-run"), _sh("--sglang", "0.5.12.post1", "--dry-run")
    assert default.returncode == explicit.returncode == 0
    assert default.stdout == explicit.stdout
    assert "bundle.py check .gpucheck" in default.stdout and "--no-index --no-deps" in default.stdout
    assert "plan: 2 processes, gloo CP group, device=cuda, SGLang kernels" in default.stdout
    assert "--sglang" not in default.stdout


def test_an_unsupported_line_is_refused():
    out = _sh("--cpu", "--sglang", "0.5.99", "--dry-run")
    assert out.returncode == 2 and "not a supported line" in out.stderr


def _entry(fmt, *, selftest=None, twin=None):
    return {
        "format": fmt,
        "selftest": selftest or {"ok": True, "stages": ["gather"], "backend": fmt, "seconds": 0.5},
        "twin": twin
        or {"identical": True, "table_translated": True, "pool_problems": [], "block_table_problems": [], "seconds": 0.2},
    }


def _rank(driver, **overrides):
    return {"formats": [overrides.get(f, _entry(f)) for f in driver.FORMATS_0_5_23]}


def test_a_failure_is_one_fail_line_naming_rank_format_and_stage(driver):
    options = driver.CheckOptions("cpu", 2, 10.0)
    ok, lines = driver.summarize_0_5_23([_rank(driver), _rank(driver)], options, 1.0)
    assert ok and lines[0].startswith("PASS 0.5.23") and "2 formats x (self-test + twin) x 2 ranks" in lines[0]
    assert "flashmla_kv/fp8_e4m3: self-test 0.50 s, twin 0.20 s" in lines[1]
    fp8 = "flashmla_kv/fp8_e4m3"
    refused = _entry(fp8, selftest={"ok": False, "stage": "translation", "error": "x"})
    ok, lines = driver.summarize_0_5_23([_rank(driver), _rank(driver, **{fp8: refused})], options, 1.0)
    assert not ok and lines[0].startswith("FAIL 0.5.23")
    assert f"rank 1 {fp8} self-test stage translation" in lines[0]
    for twin, stage in (
        ({"identical": False}, "twin stage read_path"),
        ({"table_translated": False}, "twin stage translation"),
        ({"pool_problems": ["layer 0: stray"]}, "twin stage pool: layer 0: stray"),
        ({"block_table_problems": ["row 1: disagree"]}, "twin stage block_table: row 1: disagree"),
    ):
        bad = _entry(fp8)
        bad["twin"] = dict(bad["twin"], **twin)
        ok, lines = driver.summarize_0_5_23([_rank(driver, **{fp8: bad})], options, 1.0)
        assert not ok and f"rank 0 {fp8} {stage}" in lines[0], lines


def test_main_prints_the_line_and_writes_the_report(driver, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPU_CHECK_JSON", str(tmp_path / "report.json"))
    calls = []

    def launch(world, fn, options):
        calls.append((world, fn.__name__, options))
        return [_rank(driver) for _ in range(world)]

    assert driver.main(["--sglang", "0.5.23", "--device", "cuda"]) == 2  # main dispatches the line
    assert capsys.readouterr().out.startswith("FAIL --sglang 0.5.23 runs with --device cpu only")
    assert driver.main_0_5_23(["--device", "cpu", "--cp", "3"], launch=launch) == 0
    assert calls == [(3, "check_rank_0_5_23", {"device": "cpu", "cp_size": 3, "timeout_s": 240.0})]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS 0.5.23 sharded read path == replicated (cp=3 device=cpu")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["line"] == "0.5.23" and len(report["ranks"]) == 3

    def crash(world, fn, options):
        raise RuntimeError("rank 1 failed:\nTraceback ...\nAssertionError: prefix scratch miss")

    assert driver.main_0_5_23(["--device", "cpu"], launch=crash) == 1
    assert capsys.readouterr().out.startswith("FAIL 0.5.23 stage rank: RuntimeError: AssertionError: prefix")
