"""scripts/gpu/device_check.sh --sglang 0.5.23: the shell's line switch and dry runs (CPU, and
the GPU host's offline install), the driver's one PASS/FAIL line naming the stage on CPU and on
CUDA (device, loader, ranks and kvcacheio faked), and its JSON report.

The ranks' own work runs elsewhere, so this file spawns no ranks and stays fast: the CPU
check's (``check_rank_0_5_23``: the self-test and the read-path twin per admitted format)
inside ``test/registered/multi_rank/v0_5_23/selftest/test_kv_shard_selftest_multi_rank.py``, the CUDA
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


def _gpu_run(tmp_path: Path, bundle: Path) -> subprocess.CompletedProcess:
    """The GPU run with its temporary files in ``tmp_path / "tmp"``."""
    (tmp_path / "tmp").mkdir()
    env = dict(ENV, GPUCHECK_BUNDLE=str(bundle), TMPDIR=str(tmp_path / "tmp"))
    return subprocess.run(["bash", str(SCRIPT), "--sglang", "0.5.23"], capture_output=True, text=True, timeout=60, env=env, cwd=ROOT)


def test_without_a_bundle_the_gpu_run_stops_with_one_line(tmp_path):
    out = _gpu_run(tmp_path, tmp_path / "none")
    assert out.returncode == 1
    assert out.stdout.startswith(f"FAIL no bundle at {tmp_path}/none/wheels: run scripts/gpu/prepare_bundle.sh --sglang 0.5.23")
    assert list((tmp_path / "tmp").iterdir()) == []


def test_a_failed_install_leaves_no_site_folder_behind(tmp_path):
    (tmp_path / "bundle" / "wheels").mkdir(parents=True)
    out = _gpu_run(tmp_path, tmp_path / "bundle")
    assert out.returncode == 1 and out.stdout.startswith("FAIL offline install of"), out.stdout + out.stderr
    assert list((tmp_path / "tmp").iterdir()) == []


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


# ------------------------------------------------------------------ summaries (no ranks)
def _twin(**overrides):
    return dict({"identical": True, "table_translated": True, "pool_problems": [], "block_table_problems": [], "seconds": 0.2}, **overrides)


def _trip(rank, world, layout="layer_first", **overrides):
    """One rank's passing round trip on ``layout`` (C on the last rank only)."""
    return dict(
        {
            "layout": layout, "owned_pages": {"A": 3, "C": int(rank == world - 1)},
            "acks_before_last_layer": 0, "acks_after_forward": 1,
            "pending_after_ack": {"A": False, "C": False}, "backed_up": {"A": True, "C": True},
            "loaded": {"A": [], "C": []}, "free_counts": [[2048, 4096], [2048, 4096]], "overlap_ms": None,
        },
        **overrides,
    )  # fmt: skip


def _rank_report(driver, rank, world, device="cpu", not_run=(), **overrides):
    """One rank's passing report; the round-trip layouts in ``not_run`` and their plants
    left out, as a rank told not to run them reports."""
    paths = driver.TOPK_PATHS_0_5_23 if device == "cuda" else ("torch",)
    selftest = {"ok": True, "stages": ["gather"], "backend": "b", "seconds": 0.5}
    planted_selftest = {"ok": False, "stage": "translation", "error": "layer 0 differ"}
    stale = _trip(rank, world, loaded={"A": ["layer 0 latent row 256"], "C": []})
    report = {
        "selftests": [{"format": f, "topk": p, "selftest": dict(selftest)} for f in driver.FORMATS_0_5_23 for p in paths],
        "twins": [{"format": f, "target": _twin(), "draft": _twin(seconds=0.1)} for f in driver.FORMATS_0_5_23],
        "round_trip": {layout: _trip(rank, world, layout) for layout in driver.ROUND_TRIP_LAYOUTS_0_5_23 if layout not in not_run},
        "planted": {
            "self-test": {"caught": True, "entries": [{"selftest": planted_selftest}]},
            "twin": dict(_twin(identical=False), caught=True),
            "twin-mtp": dict(_twin(identical=False), caught=True),
            **{
                name: stale for name in driver.PLANTED_0_5_23[device]
                if name.startswith("round-trip/") and name.split("/")[1] not in not_run
            },
        },
    }
    report.update(overrides)
    return report


def _main(device="cpu", d2h_of_peak=0.9):
    bw = {
        "layer_shard_bytes": 21_000_000, "owned_pages": 256, "prefix_tokens": 131072, "cp": 8, "pinned": device == "cuda",
        "d2h_gbps": 45.0, "h2d_gbps": 45.0, "peak_d2h_gbps": 50.0, "peak_h2d_gbps": 50.0, "d2h_exact": True,
        "h2d_exact": True, "d2h_of_peak": d2h_of_peak, "h2d_of_peak": 0.9,
    }  # fmt: skip
    return {
        "kvcacheio": {"ok": True, "cases": ["a", "b"], "problems": []},
        "bandwidth": bw,
        "planted": {"kvcacheio": {"caught": True}, "bandwidth-sanity": {"caught": True}},
    }


def _summarize(driver, per_rank, main, device="cpu", rank_error=None):
    return driver.summarize_0_5_23(per_rank, rank_error, main, driver.CheckOptions(device, len(per_rank or [0, 0]), 10.0), 1.0)


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_the_pass_line_counts_every_check_and_every_planted_fault_caught(driver, device):
    ranks = [_rank_report(driver, r, 2, device) for r in range(2)]
    ok, lines = _summarize(driver, ranks, _main(device), device)
    assert ok, lines
    paths = 2 if device == "cuda" else 1
    planted = len(driver.PLANTED_0_5_23[device])
    assert lines[0] == (
        f"PASS 0.5.23 sharded KV == replicated (cp=2 device={device} sglang=0.5.23, 2 formats x 2 ranks: self-test x "
        f"{paths} top-k paths, twins target + MTP draft; per-layer round trip ['layer_first', 'page_first']; "
        f"kvcacheio 2 cases byte-exact; {planted} planted faults caught)"
    )
    assert "flashmla_kv/fp8_e4m3 target 0.20 s, MTP draft 0.10 s" in lines[2]
    assert "round trip layer_first: ok" in lines and "round trip page_first: ok" in lines
    assert planted == 3 + 2 * (2 if device == "cuda" else 1) + 2  # each round-trip plant on both layouts
    assert lines[-2] == "planted faults: " + ", ".join(f"{n} caught" for n in driver.PLANTED_0_5_23[device])
    assert ("missing_wait" in lines[-2]) == (device == "cuda")


def test_each_failure_is_the_one_fail_line_naming_rank_format_and_stage(driver):
    fp8 = "flashmla_kv/fp8_e4m3"

    def first_line(mutate, main=None, device="cpu"):
        ranks = [_rank_report(driver, r, 2, device) for r in range(2)]
        mutate(ranks)
        ok, lines = _summarize(driver, ranks, main or _main(device), device)
        assert not ok and lines[0].startswith("FAIL 0.5.23"), lines
        return lines[0]

    def selftest_fails(ranks):
        ranks[1]["selftests"][1]["selftest"] = {"ok": False, "stage": "indexer", "error": "top-k differ"}

    assert f"rank 1 {fp8} top-k torch self-test stage indexer: top-k differ" in first_line(selftest_fails)

    def draft_differs(ranks):
        ranks[0]["twins"][1]["draft"] = _twin(identical=False)

    assert f"rank 0 {fp8} twin-mtp stage read_path: sharded extend != replicated" in first_line(draft_differs)

    def twin_raised(ranks):
        ranks[0]["twins"][0]["target"] = {"error": "RuntimeError: flash_mla"}

    assert "twin stage raised RuntimeError: flash_mla" in first_line(twin_raised)

    def zero_owned_rank_silent(ranks):
        ranks[0]["round_trip"]["layer_first"]["acks_after_forward"] = 0

    assert "round trip layer_first: rank 0: 0 acks after the forward (one expected)" in first_line(zero_owned_rank_silent)

    def stale_load(ranks):
        ranks[1]["round_trip"]["layer_first"]["loaded"]["C"] = ["layer 2 latent row 64"]

    assert "round trip layer_first: rank 1 C: load-back not byte-exact" in first_line(stale_load)

    def stale_page_first(ranks):
        ranks[0]["round_trip"]["page_first"]["loaded"]["A"] = ["layer 1 indexer page 3"]

    assert "round trip page_first: rank 0 A: load-back not byte-exact" in first_line(stale_page_first)

    def plant_missed(ranks):
        ranks[1]["planted"]["twin-mtp"]["caught"] = False

    assert "planted fault twin-mtp not caught" in first_line(plant_missed)

    def plant_crashed(ranks):  # a crash in the round trip is no catch
        ranks[0]["planted"]["round-trip/page_first/layer_copy_dropped"] = {"error": "RuntimeError: boom"}

    assert "planted fault round-trip/page_first/layer_copy_dropped not caught" in first_line(plant_crashed)
    main = _main()
    main["planted"]["kvcacheio"]["caught"] = False
    assert "planted fault kvcacheio not caught" in first_line(lambda ranks: None, main)
    main = _main()
    main["kvcacheio"]["problems"] = ["latent_fp8/page_first layer 1: the per-layer load wrote rows it was not given"]
    assert "stage kvcacheio: latent_fp8/page_first layer 1" in first_line(lambda ranks: None, main)


def test_the_bandwidth_target_holds_on_the_gpu_and_is_only_reported_on_cpu(driver):
    slow = _main("cuda", d2h_of_peak=0.5)
    ok, lines = _summarize(driver, [_rank_report(driver, r, 2, "cuda") for r in range(2)], slow, "cuda")
    assert not ok and "stage bandwidth: d2h 50% of pinned peak, below the 80% target" in lines[0]
    ok, lines = _summarize(driver, [_rank_report(driver, r, 2) for r in range(2)], _main("cpu", d2h_of_peak=0.01))
    assert ok and any("CPU: figures only" in line for line in lines)
    assert driver.bandwidth_problems(dict(_main()["bandwidth"], h2d_exact=False), "cpu") == ["h2d bytes did not arrive"]
    assert "more than a copy" in driver.bandwidth_problems(dict(_main()["bandwidth"], d2h_of_peak=2.0), "cuda")[0]


def test_the_planted_bandwidth_and_kvcacheio_faults_are_caught_on_cpu(driver):
    """The main-process plants run for real here (torch only): a half copy, a misplaced load."""
    import torch

    main = driver.main_process_0_5_23(torch.device("cpu"))
    assert main["kvcacheio"]["problems"] == [] and len(main["kvcacheio"]["cases"]) == 6
    assert main["bandwidth"]["d2h_exact"] and main["bandwidth"]["h2d_exact"]
    assert main["planted"]["kvcacheio"]["caught"] and main["planted"]["bandwidth-sanity"]["caught"]


def test_a_crashed_rank_is_a_fail_line_and_the_main_process_checks_still_report(driver):
    ok, lines = _summarize(driver, None, _main(), rank_error=RuntimeError("rank 1 failed:\nTraceback\nAssertionError: scratch"))
    assert not ok and lines[0].startswith("FAIL 0.5.23") and "stage rank: RuntimeError: AssertionError: scratch" in lines[0]
    assert any(line.startswith("owned shard per layer") for line in lines)


def test_main_prints_the_line_and_writes_the_report(driver, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("GPU_CHECK_JSON", str(tmp_path / "report.json"))
    monkeypatch.setattr(driver, "main_process_0_5_23", lambda device: _main(device.type))
    calls = []

    def launch(world, fn, options):
        calls.append((world, fn.__name__, options))
        return [_rank_report(driver, r, world) for r in range(world)]

    assert driver.main_0_5_23(["--device", "cpu", "--cp", "3"], launch=launch) == 0
    assert calls == [(3, "check_rank_0_5_23", {"device": "cpu", "cp_size": 3, "timeout_s": 240.0, "round_trip_not_run": {}})]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS 0.5.23 sharded KV == replicated (cp=3 device=cpu")
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["line"] == "0.5.23" and len(report["ranks"]) == 3
    assert set(report["planted"]) == {"kvcacheio", "bandwidth-sanity"} and "bandwidth" in report
    assert report["not_run"] == {} and "page_first_jit" not in report  # on CPU page_first always runs

    def crash(world, fn, options):
        raise RuntimeError("rank 1 failed:\nTraceback ...\nAssertionError: prefix scratch miss")

    assert driver.main_0_5_23(["--device", "cpu"], launch=crash) == 1
    assert "stage rank: RuntimeError: AssertionError: prefix" in capsys.readouterr().out.splitlines()[0]


# ------------------------------------------------------------------------ CUDA mode
@pytest.fixture
def cuda_host(driver, monkeypatch, tmp_path):
    """The CUDA branch of main_0_5_23 with the device, the loader and the main-process
    checks faked."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "fake H200")
    monkeypatch.setenv("GPU_CHECK_JSON", str(tmp_path / "report.json"))
    state = {"load": {"ok": True, "modules": {}}, "main": _main("cuda"), "probe": {"available": True, "reason": None}}
    monkeypatch.setattr(driver, "load_kernels_0_5_23", lambda: state["load"])
    monkeypatch.setattr(driver, "probe_page_first_jit_0_5_23", lambda: state["probe"])
    monkeypatch.setattr(driver, "main_process_0_5_23", lambda device: state["main"])
    state["report"] = lambda: json.loads((tmp_path / "report.json").read_text())
    return state


def test_cuda_runs_the_same_ranks_and_reports_versions(driver, cuda_host, capsys):
    calls = []

    def launch(world, fn, options):
        calls.append((world, fn.__name__, options["device"]))
        return [_rank_report(driver, r, world, "cuda") for r in range(world)]

    assert driver.main_0_5_23(["--device", "cuda"], launch=launch) == 0
    assert calls == [(2, "check_rank_0_5_23", "cuda")]
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS 0.5.23 sharded KV == replicated (cp=2 device=cuda") and "9 planted faults caught" in out[0]
    report = cuda_host["report"]()
    assert report["ok"] is True and "sgl-flash-mla" in report["versions"] and report["versions"]["gpu"] == "fake H200"


def test_a_crashed_cuda_rank_still_reports_the_main_process_checks(driver, cuda_host, capsys):
    def crash(world, fn, options):
        raise RuntimeError("rank 0 failed:\nTraceback ...\nRuntimeError: Triton compile failed")

    assert driver.main_0_5_23(["--device", "cuda"], launch=crash) == 1
    assert "stage rank: RuntimeError: RuntimeError: Triton compile failed" in capsys.readouterr().out.splitlines()[0]
    assert cuda_host["report"]()["kvcacheio"]["cases"] == ["a", "b"]


def test_the_dry_runs_name_the_round_trip_the_twins_and_the_planted_faults():
    for args, device in ((("--cpu",), "cpu"), ((), "cuda")):
        out = _sh(*args, "--sglang", "0.5.23", "--dry-run")
        assert out.returncode == 0, out.stderr
        assert "target extend and MTP draft extend" in out.stdout
        assert "per host layout ['layer_first', 'page_first']" in out.stdout and "refused" not in out.stdout
        assert "a zero-owned one too" in out.stdout and "owned-shard D2H/H2D GB/s" in out.stdout
        assert ("missing_wait" in out.stdout) == (device == "cuda")
        assert (">= 80% of pinned peak" in out.stdout) == (device == "cuda")


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


def test_on_cuda_the_round_trip_needs_layer_0_on_host_before_the_last_layers_stores(driver):
    ranks = [_rank_report(driver, r, 2, "cuda") for r in range(2)]
    for rank, overlap in enumerate((4.8, -0.2)):
        ranks[rank]["round_trip"]["layer_first"]["overlap_ms"] = overlap
    ok, lines = _summarize(driver, ranks, _main("cuda"), "cuda")
    assert not ok and "round trip layer_first: rank 1: layer 0's copy ended 0.200 ms after the last layer's stores" in lines[0]
    ranks[1]["round_trip"]["layer_first"]["overlap_ms"] = 4.6
    ok, lines = _summarize(driver, ranks, _main("cuda"), "cuda")
    assert ok and "round trip layer_first: ok, layer 0 on host 4.60-4.80 ms before the last layer's stores" in lines


def test_the_driver_names_the_round_trip_layouts_and_plants_the_ranks_run(driver):
    """The dry run and the verdict use the driver's names (no torch); the ranks run the
    testing module's: they must agree, or a plant would read as not caught."""
    from sglang_cp_hicache.testing.v0_5_23 import layer_round_trip

    assert driver.ROUND_TRIP_LAYOUTS_0_5_23 == layer_round_trip.LAYOUTS
    for device in ("cpu", "cuda"):
        named = [n for n in driver.PLANTED_0_5_23[device] if n.startswith("round-trip/")]
        plants = layer_round_trip.plants_for(device)
        assert driver.ROUND_TRIP_PLANTS_0_5_23[device] == plants
        assert named == [f"round-trip/{layout}/{p}" for layout in layer_round_trip.LAYOUTS for p in plants]


# ------------------------------------------------- page_first and the JIT kernel (CUDA)
JIT_REASON = (
    "latent 1152-byte items: Failed to load JIT HiCache kernel: Failed to build JIT module hicache_1152_1_2_1024"
    "; missing here: nvcc, cuda_runtime.h, libcudart.so"
)
NOT_RUN = f"JIT HiCache kernel unavailable on this host ({JIT_REASON})"
PAGE_FIRST_PLANTS = ["round-trip/page_first/layer_copy_dropped", "round-trip/page_first/missing_wait"]


def _cuda_run(driver, cuda_host, capsys, mutate=lambda ranks: None):
    """main_0_5_23 on the faked CUDA host; the ranks report what they were told to run."""
    told = []

    def launch(world, fn, options):
        told.append(options["round_trip_not_run"])
        ranks = [_rank_report(driver, r, world, "cuda", not_run=options["round_trip_not_run"]) for r in range(world)]
        mutate(ranks)
        return ranks

    rc = driver.main_0_5_23(["--device", "cuda"], launch=launch)
    return rc, told, capsys.readouterr().out.splitlines(), cuda_host["report"]()


def test_without_the_jit_kernel_page_first_is_named_not_run_with_the_reason(driver, cuda_host, capsys):
    cuda_host["probe"] = {"available": False, "reason": JIT_REASON, "toolchain": {"nvcc": None}}
    rc, told, out, report = _cuda_run(driver, cuda_host, capsys)
    assert told == [{"page_first": NOT_RUN}]  # the ranks leave it out, told why
    assert rc == 0 and out[0].startswith("PASS 0.5.23 sharded KV == replicated (cp=2 device=cuda")
    assert "per-layer round trip ['layer_first']; kvcacheio 2 cases byte-exact; 7 planted faults caught)" in out[0]
    assert out[0].endswith(f"; round trip page_first NOT RUN: {NOT_RUN}; its planted faults {PAGE_FIRST_PLANTS} not run either")
    assert f"round trip page_first: NOT RUN ({NOT_RUN})" in out
    assert out[-2].endswith(", ".join(f"{n} NOT RUN" for n in PAGE_FIRST_PLANTS))
    assert report["ok"] is True and report["page_first_jit"]["reason"] == JIT_REASON
    assert report["not_run"] == {name: f"not run: {NOT_RUN}" for name in ["round-trip/page_first", *PAGE_FIRST_PLANTS]}
    assert report["summary"][0] == out[0]


def test_without_the_jit_kernel_a_failed_layer_first_still_fails_the_check(driver, cuda_host, capsys):
    cuda_host["probe"] = {"available": False, "reason": JIT_REASON}

    def stale_layer_first(ranks):
        ranks[1]["round_trip"]["layer_first"]["loaded"]["C"] = ["layer 2 latent row 64"]

    rc, _, out, report = _cuda_run(driver, cuda_host, capsys, stale_layer_first)
    assert rc == 1 and out[0].startswith("FAIL 0.5.23") and "round trip layer_first: rank 1 C: load-back not byte-exact" in out[0]
    assert f"round trip page_first NOT RUN: {NOT_RUN}" in out[0]  # never silent, on FAIL too
    assert report["ok"] is False and "round-trip/page_first" in report["not_run"]

    def missed_plant(ranks):  # no stale load on any rank: not caught
        for rank, report in enumerate(ranks):
            report["planted"]["round-trip/layer_first/missing_wait"] = _trip(rank, 2)

    rc, _, out, _ = _cuda_run(driver, cuda_host, capsys, missed_plant)
    assert rc == 1 and "planted fault round-trip/layer_first/missing_wait not caught" in out[0]


def test_with_the_jit_kernel_page_first_runs_and_must_pass(driver, cuda_host, capsys):
    rc, told, out, report = _cuda_run(driver, cuda_host, capsys)
    assert told == [{}] and rc == 0 and "NOT RUN" not in "\n".join(out) and report["not_run"] == {}
    assert "per-layer round trip ['layer_first', 'page_first']" in out[0] and "9 planted faults caught" in out[0]

    def stale_page_first(ranks):
        ranks[0]["round_trip"]["page_first"]["loaded"]["A"] = ["layer 1 indexer page 3"]

    rc, _, out, _ = _cuda_run(driver, cuda_host, capsys, stale_page_first)
    assert rc == 1 and "round trip page_first: rank 0 A: load-back not byte-exact" in out[0]

    def page_first_left_out(ranks):  # a rank that skipped it unasked
        for rank in ranks:
            del rank["round_trip"]["page_first"]
            for name in PAGE_FIRST_PLANTS:
                del rank["planted"][name]

    rc, _, out, _ = _cuda_run(driver, cuda_host, capsys, page_first_left_out)
    assert rc == 1 and "round trip page_first: not reported by the ranks" in out[0]
    assert "round-trip/page_first/missing_wait NOT caught" in out[-2]


def test_the_ranks_leave_out_exactly_the_layouts_they_are_told(driver, monkeypatch):
    """``_rank_round_trips`` (CPU group: no shim) runs each layout not in ``not_run`` and
    its plants, nothing of the other."""
    import types

    from sglang_cp_hicache.testing.v0_5_23 import layer_round_trip

    ran = []
    monkeypatch.setattr(layer_round_trip, "round_trip", lambda ctx, device, layout, **kw: ran.append(layout) or {"layout": layout})
    group = types.SimpleNamespace(device=types.SimpleNamespace(type="cpu"))
    layouts, planted = driver._rank_round_trips(None, group, {"page_first": NOT_RUN})
    assert list(layouts) == ["layer_first"] and list(planted) == ["round-trip/layer_first/layer_copy_dropped"]
    assert ran == ["layer_first", "layer_first"]
    layouts, planted = driver._rank_round_trips(None, group, {})
    assert list(layouts) == ["layer_first", "page_first"] and len(planted) == 2
