"""scripts/glm5: every script's --dry-run, and the metrics/log helpers the runs rely on."""

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[5]
GLM5 = ROOT / "scripts" / "glm5"


def _glm5():
    spec = importlib.util.spec_from_file_location("glm5_pd", GLM5 / "glm5_pd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _dry_run(script, *extra):
    out = subprocess.run(
        ["bash", str(GLM5 / script), "--dry-run", *extra], capture_output=True, text=True, timeout=60,
        env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_prefill_launch_command():
    out = _dry_run("launch_prefill.sh")
    for flag in ("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1", "-m sglang.launch_server",
                 "--model-path zai-org/GLM-5-FP8", "--tp 8", "--enable-nsa-prefill-context-parallel",
                 "--enable-nsa-prefill-cp-shared-kv", "--enable-hierarchical-cache",
                 "--disaggregation-mode prefill", "--enable-metrics"):
        assert flag in out


def test_decode_and_router_launch_commands():
    decode = _dry_run("launch_decode.sh")
    assert "--disaggregation-mode decode" in decode and "--base-gpu-id 8" in decode
    assert "--enable-nsa-prefill-cp-shared-kv" not in decode
    router = _dry_run("launch_router.sh")
    assert "-m sglang_router.launch_router --pd-disaggregation" in router
    assert "--prefill http://127.0.0.1:30000 8998 --decode http://127.0.0.1:30001" in router


@pytest.mark.parametrize("script,needle", [("run_repeated_prefix.sh", "--hicache-ratio 2.0"),
                                           ("run_host_pressure.sh", "--hicache-size 40")])
def test_workload_runs_print_all_three_commands_and_the_plan(script, needle):
    out = _dry_run(script)
    assert out.count("sglang.launch_server") == 2 and "sglang_router" in out
    assert needle in out
    assert "sglang:max_total_num_tokens" in out and "hit rates" in out
    no_launch = _dry_run(script, "--no-launch", "--num-prefixes", "4")
    assert "launch_server" not in no_launch and "4 prefixes" in no_launch


METRICS = """
# HELP sglang:prompt_tokens_total Number of prefill tokens processed.
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 1000.0
sglang:prompt_tokens_total{model_name="m",tp_rank="1"} 1000.0
sglang:cached_tokens_total{cache_source="device",model_name="m"} 300.0
sglang:cached_tokens_total{cache_source="host",model_name="m"} 500.0
sglang:cached_tokens_total{cache_source="total",model_name="m"} 800.0
sglang:max_total_num_tokens{model_name="m"} 4096.0
"""


def test_hit_rates_and_capacity_from_metrics():
    glm5 = _glm5()
    rates = glm5.hit_rates(METRICS)
    assert rates.rate("total") == pytest.approx(0.4) and rates.rate("host") == pytest.approx(0.25)
    assert "host 25.0%" in rates.line()
    assert glm5.device_capacity_tokens(METRICS) == 4096
    assert glm5.auto_num_prefixes(4096, 1024, 1.5) == 6


SHARDED_0_5_23_METRICS = """
sglang:max_total_num_tokens{model_name="m",tp_rank="0"} 2048.0
sglang:kv_available_tokens{model_name="m",tp_rank="0"} 3000.0
sglang:kv_used_tokens{model_name="m",tp_rank="0"} 192.0
sglang:kv_evictable_tokens{model_name="m",tp_rank="0"} 904.0
sglang:max_total_num_tokens{model_name="m",tp_rank="1"} 2048.0
sglang:prompt_tokens_total{model_name="m",tp_rank="0"} 1000.0
sglang:cached_tokens_total{cache_source="device",model_name="m",tp_rank="0"} 300.0
sglang:cached_tokens_total{cache_source="host",model_name="m",tp_rank="0"} 100.0
"""


def test_capacity_is_the_logical_pool_where_the_metric_is_a_ranks_physical_tokens():
    """0.5.23's native sharding reports one rank's physical tokens as
    ``max_total_num_tokens``; its logical pool is available + used (the repeated-prefix
    workload sized from 2048 would never evict on a 4096-token logical pool)."""
    glm5 = _glm5()
    assert glm5.device_capacity_tokens(SHARDED_0_5_23_METRICS) == 4096
    assert glm5.hit_rates(SHARDED_0_5_23_METRICS).rate("total") == pytest.approx(0.4)  # no "total" source


def test_log_scan_finds_errors(tmp_path):
    glm5 = _glm5()
    log = tmp_path / "prefill.log"
    log.write_text("INFO ok\nTraceback (most recent call last):\nSharedKVUnsupportedPath: x\n")
    assert len(glm5.log_errors([log, tmp_path / "missing.log"])) == 2


def test_workload_revisits_each_prefix_after_all_others():
    glm5 = _glm5()
    workload = glm5.Workload(num_prefixes=3, prefix_tokens=16, suffix_tokens=2, rounds=2)
    requests = list(workload.requests())
    assert len(requests) == 6
    assert [r[:16] for r in requests[:3]] == [r[:16] for r in requests[3:]]
    assert requests[0][:16] != requests[1][:16] and requests[0][16:] != requests[3][16:]


def test_component_run_tees_output_and_fails_on_error_lines(tmp_path, capsys):
    glm5 = _glm5()
    d = glm5.Deployment(log_dir=str(tmp_path))
    ok = glm5.run_component("router", [sys.executable, "-c", "print('ready')"], {}, d, 0)
    assert ok == 0 and (tmp_path / "router.log").read_text() == "ready\n"
    bad = glm5.run_component("decode", [sys.executable, "-c", "print('CUDA error: x')"], {}, d, 0)
    assert bad == 1 and "FAIL decode" in capsys.readouterr().out


def test_two_nodes_decode_base_gpu_0_remote_decode_and_routable_hosts():
    hosts = ("--host", "10.0.0.1", "--decode-host", "10.0.0.2", "--nodes", "2", "--ib-device", "mlx5_0")
    decode = _dry_run("launch_decode.sh", *hosts)
    assert "--base-gpu-id 0" in decode and "--host 10.0.0.2" in decode and "--disaggregation-ib-device mlx5_0" in decode
    run = _dry_run("run_repeated_prefix.sh", *hosts)
    assert run.count("sglang.launch_server") == 2 and "decode: remote, on the decode node" in run
    assert "--prefill http://10.0.0.1:30000 8998 --decode http://10.0.0.2:30001" in run
    out = subprocess.run(
        ["bash", str(GLM5 / "run_repeated_prefix.sh"), "--dry-run", "--nodes", "2"],
        capture_output=True, text=True, timeout=60, env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 2 and "needs a routable --host" in out.stdout


def test_missing_mooncake_or_router_fails_with_a_clear_message(monkeypatch, capsys):
    glm5 = _glm5()
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name in ("mooncake", "sglang_router") else real(name))
    assert glm5.missing_dependencies(["prefill", "router"]) == ["mooncake-transfer-engine", "sglang-router"]
    assert glm5.main(["prefill"]) == 2
    assert "FAIL missing mooncake-transfer-engine" in capsys.readouterr().out
    assert glm5.main(["repeated-prefix", "--no-launch", "--dry-run", "--num-prefixes", "2"]) == 0
    assert glm5.main(["router", "--dry-run"]) == 0
    assert "note: missing sglang-router" in capsys.readouterr().out


def test_probes_cold_device_host_must_agree():
    glm5 = _glm5()

    def response(ids, logprob, cached):
        return {"output_ids": ids, "meta_info": {"cached_tokens": cached,
                                                 "output_token_logprobs": [[logprob, ids[0], None]]}}

    cold = glm5.parse_probe("cold", response([5, 6], -0.50, 0))
    device = glm5.parse_probe("device", response([5, 6], -0.51, 960))
    host = glm5.parse_probe("host", response([5, 6], -0.49, 960))
    assert cold.output_ids == (5, 6) and cold.first_logprob == -0.5
    assert glm5.probe_divergences([cold, device, host], 0.02) == []
    diverged = glm5.parse_probe("host", response([5, 7], -0.80, 960))
    problems = glm5.probe_divergences([cold, device, diverged], 0.02)
    assert any("host-hit greedy output" in p for p in problems)
    assert any("first-token logprob" in p for p in problems)
    assert glm5.probe_divergences([cold, glm5.parse_probe("device", response([5, 6], -0.5, 0))], 0.02) == [
        "device-hit probe had no cached tokens"
    ]


def test_send_workload_probes_cold_then_device_then_host_per_round(monkeypatch):
    glm5 = _glm5()
    workload = glm5.Workload(num_prefixes=3, prefix_tokens=8, suffix_tokens=2, rounds=2)
    calls = []

    def generate(url, input_ids, max_new_tokens, timeout_s, logprobs=False):
        calls.append(("probe" if logprobs else "request", tuple(input_ids[:8])))
        cached = 0 if len([c for c in calls if c[0] == "probe"]) == 1 else 8
        return {"output_ids": [1], "meta_info": {"cached_tokens": cached, "output_token_logprobs": [[-0.1, 1, None]]}}

    monkeypatch.setattr(glm5, "generate", generate)
    assert glm5.send_workload("http://x", workload, probes=1) == []
    kinds = [c[0] for c in calls]
    assert kinds == ["probe", "probe", "request", "request", "request", "probe", "request", "request", "request"]
    assert len({c[1] for c in calls if c[0] == "probe"}) == 1


def test_no_launch_names_endpoints_only_and_skips_launch_checks():
    """--no-launch launches nothing, so the two-node launch checks do not apply; a component
    subcommand with --no-launch checks its running endpoint instead of starting a server."""
    run = _dry_run("run_repeated_prefix.sh", "--no-launch", "--nodes", "2")
    assert "launch_server" not in run and "sglang_router.launch_router" not in run
    assert "no launch: GET http://127.0.0.1:30000/health; GET http://127.0.0.1:30001/health" in run
    decode = _dry_run("launch_decode.sh", "--no-launch", "--decode-host", "10.0.0.2")
    assert "launch_server" not in decode and "note: missing" not in decode
    assert decode.strip() == "no launch: GET http://10.0.0.2:30001/health"
    prefill = _dry_run("launch_prefill.sh", "--no-launch")
    assert "GET http://127.0.0.1:30000/metrics -> hit rates" in prefill


class _Health:
    """A local HTTP server answering ``/health`` 200 (a running endpoint)."""

    def __enter__(self):
        import http.server
        import threading

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(200 if self.path == "/health" else 404)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return self.server.server_address[1]

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


def _closed_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_no_launch_workload_fails_cleanly_on_a_down_endpoint(monkeypatch, capsys, tmp_path):
    glm5 = _glm5()
    monkeypatch.setattr(glm5, "NO_LAUNCH_HEALTH_TIMEOUT_S", 0.0)
    started = []
    monkeypatch.setattr(glm5.Launched, "start", lambda self, name, cmd: started.append(name))
    with _Health() as up:
        d = glm5.Deployment(prefill_port=up, decode_port=_closed_port(), router_port=up, log_dir=str(tmp_path))
        assert glm5.running_endpoint_problems(d, ["prefill", "router"], 0.0) == []
        workload = glm5.Workload(num_prefixes=1, prefix_tokens=8, rounds=1)
        assert glm5.run_workload(d, workload, 1.5, launch=False, startup_timeout_s=0) == 1
    out = capsys.readouterr().out
    assert started == []
    assert f"error: decode at http://127.0.0.1:{d.decode_port} is not healthy" in out
    assert "FAIL 1 endpoints not healthy" in out


def test_component_no_launch_checks_its_endpoint(monkeypatch, capsys, tmp_path):
    glm5 = _glm5()
    monkeypatch.setattr(glm5, "NO_LAUNCH_HEALTH_TIMEOUT_S", 0.0)
    monkeypatch.setattr(glm5, "run_component", lambda *a, **k: pytest.fail("--no-launch started a server"))
    with _Health() as up:
        d = glm5.Deployment(decode_port=up)
        assert glm5.check_running_component(d, "decode", dry_run=False) == 0
    assert "PASS decode" in capsys.readouterr().out
    d = glm5.Deployment(decode_port=_closed_port())
    assert glm5.check_running_component(d, "decode", dry_run=False) == 1
    assert "is not healthy" in capsys.readouterr().out
