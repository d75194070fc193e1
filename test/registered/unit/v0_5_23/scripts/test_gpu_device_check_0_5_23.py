"""scripts/gpu/device_check.sh --sglang 0.5.23: the shell's line switch and dry runs (CPU, and
the GPU host's offline install), the driver's one PASS/FAIL line naming the stage on CPU and on
CUDA (device, loader, ranks and kvcacheio faked), and its JSON report.

The ranks' own work runs elsewhere, so this file spawns no ranks and stays fast: the CPU
check's (``check_rank_0_5_23``: the self-test and the read-path twin per admitted format)
inside ``test/registered/multi_rank/v0_5_23/test_kv_shard_selftest_multi_rank.py``, the CUDA
check's (``gpu_selftest.run_selftests`` and ``kvcacheio_check``) on CPU ranks in
``test_gpu_selftest_0_5_23.py``.
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


def test_the_gpu_dry_run_installs_the_0_5_23_bundle_and_plans_load_selftest_and_kvcacheio(driver):
    out = _sh("--sglang", "0.5.23", "--dry-run")
    assert out.returncode == 0, out.stderr
    assert "bundle.py check --line 0.5.23 .gpucheck-0.5.23 && " in out.stdout
    assert "--no-index --no-deps --no-compile --target <temp dir> .gpucheck-0.5.23/wheels/*.whl" in out.stdout
    assert "device_check.py --sglang 0.5.23 --device cuda --cp 2 --timeout 340" in out.stdout
    assert "load sglang-kernel and sgl-flash-mla" in out.stdout and "host-staged gathers" in out.stdout
    assert "top-k path ['jit-v2', 'sgl-kernel']" in out.stdout and "layer_first, page_first" in out.stdout
    from sglang_cp_hicache.testing.v0_5_23.gpu_selftest import CUDA_TOPK_PATHS

    assert driver.TOPK_PATHS_0_5_23 == tuple(CUDA_TOPK_PATHS)  # the dry run names what runs


def test_without_a_bundle_the_gpu_run_stops_with_one_line(tmp_path):
    env = dict(ENV, GPUCHECK_BUNDLE=str(tmp_path / "none"))
    out = subprocess.run(["bash", str(SCRIPT), "--sglang", "0.5.23"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)
    assert out.returncode == 1
    assert out.stdout.startswith(f"FAIL no bundle at {tmp_path}/none/wheels: run scripts/gpu/prepare_bundle.sh --sglang 0.5.23")


def test_the_default_stays_the_0_5_12_prepared_check():
    default, explicit = _sh("--dry-run"), _sh("--sglang", "0.5.12.post1", "--dry-run")
    assert default.returncode == explicit.returncode == 0
    assert default.stdout == explicit.stdout
    assert "bundle.py check --line 0.5.12.post1 .gpucheck" in default.stdout and "--no-index --no-deps" in default.stdout
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


# ------------------------------------------------------------------------ CUDA mode
def _cuda_entries(driver, failing=None):
    """One rank's CUDA report: every format x top-k path passing but ``failing``
    ((format, path) -> the self-test's failure entry)."""
    entries = []
    for fmt in driver.FORMATS_0_5_23:
        for path in driver.TOPK_PATHS_0_5_23:
            test = (failing or {}).get((fmt, path)) or {"ok": True, "stages": ["gather"], "backend": fmt, "seconds": 1.5}
            entries.append({"format": fmt, "topk": path, "selftest": test})
    return {"entries": entries}


@pytest.fixture
def cuda_host(driver, monkeypatch, tmp_path):
    """The CUDA branch of main_0_5_23 with the device, the loader and kvcacheio faked."""
    import torch

    from sglang_cp_hicache.testing.v0_5_23 import gpu_selftest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setenv("GPU_CHECK_JSON", str(tmp_path / "report.json"))
    state = {"load": {"ok": True, "modules": {}}, "kvcacheio": {"ok": True, "cases": ["a", "b"], "problems": []}}
    monkeypatch.setattr(driver, "load_kernels_0_5_23", lambda: state["load"])
    monkeypatch.setattr(gpu_selftest, "kvcacheio_check", lambda device: state["kvcacheio"])
    state["report"] = lambda: json.loads((tmp_path / "report.json").read_text())
    return state


def test_cuda_pass_line_counts_formats_topk_paths_and_kvcacheio_cases(driver, cuda_host, capsys):
    calls = []

    def launch(world, fn, options):
        calls.append((world, fn.__name__, options["device"]))
        return [_cuda_entries(driver) for _ in range(world)]

    assert driver.main_0_5_23(["--device", "cuda"], launch=launch) == 0
    assert calls == [(2, "check_rank_0_5_23_cuda", "cuda")]
    out = capsys.readouterr().out.splitlines()
    assert out[0] == (
        "PASS 0.5.23 sharded read path == replicated on the GPU (cp=2 device=cuda sglang=0.5.23, "
        "2 formats x 2 top-k paths x 2 ranks; kvcacheio MLA transfers byte-exact, 2 cases)"
    )
    assert "flashmla_kv/fp8_e4m3 top-k sgl-kernel: 1.50 s" in out[1]
    report = cuda_host["report"]()
    assert report["ok"] is True and report["line"] == "0.5.23" and len(report["ranks"]) == 2
    assert "sgl-flash-mla" in report["versions"] and report["versions"]["gpu"] == "fake H200"


def test_cuda_failures_name_rank_format_topk_path_stage_or_the_kvcacheio_case(driver, cuda_host, capsys):
    fp8 = "flashmla_kv/fp8_e4m3"
    bad = {(fp8, "sgl-kernel"): {"ok": False, "stage": "indexer", "error": "top-k differ"}}

    def launch(world, fn, options):
        return [_cuda_entries(driver), _cuda_entries(driver, bad)]

    assert driver.main_0_5_23(["--device", "cuda"], launch=launch) == 1
    line = capsys.readouterr().out.splitlines()[0]
    assert line == f"FAIL 0.5.23 on the GPU (cp=2 device=cuda sglang=0.5.23): rank 1 {fp8} top-k sgl-kernel self-test stage indexer: top-k differ (+0 more)"
    cuda_host["kvcacheio"] = {"ok": False, "cases": ["a"], "problems": ["latent_bf16/page_first layer 2: the per-layer load put other bytes on the device"]}
    assert driver.main_0_5_23(["--device", "cuda"], launch=lambda w, fn, o: [_cuda_entries(driver)] * w) == 1
    assert capsys.readouterr().out.startswith("FAIL 0.5.23 on the GPU (cp=2 device=cuda sglang=0.5.23): stage kvcacheio: latent_bf16/page_first layer 2")


def test_a_crashed_rank_is_the_line_and_kvcacheio_still_runs(driver, cuda_host, capsys):
    def crash(world, fn, options):
        raise RuntimeError("rank 0 failed:\nTraceback ...\nRuntimeError: Triton compile failed")

    assert driver.main_0_5_23(["--device", "cuda"], launch=crash) == 1
    assert capsys.readouterr().out.startswith("FAIL 0.5.23 on the GPU (cp=2 device=cuda sglang=0.5.23): stage rank: RuntimeError: RuntimeError: Triton compile failed")
    assert cuda_host["report"]()["kvcacheio"]["cases"] == ["a", "b"]


def test_a_kernel_that_does_not_load_stops_before_any_rank(driver, cuda_host, capsys):
    cuda_host["load"] = {"ok": False, "error": "sglang-kernel: ImportError: common_ops.abi3.so: undefined symbol: _ZN5torch7Library4_def"}

    def launch(world, fn, options):
        raise AssertionError("no rank may start when the kernels do not load")

    assert driver.main_0_5_23(["--device", "cuda"], launch=launch) == 1
    assert capsys.readouterr().out.strip() == (
        "FAIL 0.5.23 on the GPU (device=cuda sglang=0.5.23): stage load: "
        "sglang-kernel: ImportError: common_ops.abi3.so: undefined symbol: _ZN5torch7Library4_def"
    )
    assert cuda_host["report"]()["ok"] is False


def test_the_loader_reason_is_sgl_kernels_first_attempt(driver):
    message = (
        "\n[sgl_kernel] CRITICAL: Could not load any common_ops library!\n\nError details from previous import attempts:\n"
        "- ImportError: /site/sgl_kernel/sm90/common_ops.abi3.so: undefined symbol: _ZN3c104cuda29c10_cuda_check\n"
        "- ModuleNotFoundError: No module named 'common_ops'\n"
    )
    assert driver._loader_reason(ImportError(message)) == (
        "ImportError: /site/sgl_kernel/sm90/common_ops.abi3.so: undefined symbol: _ZN3c104cuda29c10_cuda_check"
    )
    assert driver._loader_reason(OSError("libcuda.so.1: cannot open shared object file")) == (
        "OSError: libcuda.so.1: cannot open shared object file"
    )


def test_without_a_visible_gpu_the_cuda_mode_says_so(driver, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert driver.main_0_5_23(["--device", "cuda"], launch=lambda *a: pytest.fail("no rank without a GPU")) == 1
    assert capsys.readouterr().out.startswith("FAIL no CUDA device visible")
