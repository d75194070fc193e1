"""The serving harness's parts that need no SGLang server (``testing/server/``): process groups
ended and checked, bounded readiness, the CPU runtime's step log and ``sgl_kernel`` stand-in,
the tiny checkpoint, metrics and ``/generate`` parsing, prompt scaling, the comparison.
Runs in both venvs."""

from __future__ import annotations

import hashlib
import http.server
import json
import logging
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from sglang_cp_hicache.testing.device import CPU_DEVICE_MODULE, CpuEvent
from sglang_cp_hicache.testing.server import sgl_kernel_stand_in
from sglang_cp_hicache.testing.server.cluster import ServingCluster, log_errors
from sglang_cp_hicache.testing.server.client import Completion, RequestFailed, generate, post
from sglang_cp_hicache.testing.server.launch import SERVER_KEEP_ALIVE_S, Endpoint, PrefillSpec, ServerEnv, prefill_argv
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.processes import ManagedProcess, NotReady, ProcessDied
from sglang_cp_hicache.testing.server.runtime import RuntimeStep, ServerRuntime, write_site_folder
from sglang_cp_hicache.testing.server.scenarios import Recorder, ScenarioReport, scenarios_for
from sglang_cp_hicache.testing.server.trace_replay import scaled_prompt, trace_prompts
from sglang_cp_hicache.testing.server.tiny_model import TinyDsaSpec, build_checkpoint, ensure_checkpoint
from sglang_cp_hicache.testing.v0_5_12.server_launch import LAUNCH as LAUNCH_0512
from sglang_cp_hicache.testing.v0_5_23.server_launch import LAUNCH as LAUNCH_0523


# ------------------------------------------------------------------------ processes
def _python(tmp_path: Path, name: str, body: str, ready=lambda: True, within: float = 10.0) -> ManagedProcess:
    argv = [sys.executable, "-c", textwrap.dedent(body)]
    return ManagedProcess(name, argv, {"PATH": "/usr/bin:/bin"}, tmp_path / f"{name}.log", ready, within)


def test_stop_ends_the_whole_group_even_a_child_that_ignores_sigterm(tmp_path):
    marker = tmp_path / "child.pid"
    body = f"""
        import signal, subprocess, sys, time
        child = subprocess.Popen([sys.executable, "-c",
            "import signal, time, os; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
            "open({str(marker)!r}, 'w').write(str(os.getpid())); time.sleep(600)"])
        time.sleep(600)
    """
    process = _python(tmp_path, "parent", body, ready=marker.exists).start()
    process.wait_ready()
    child = int(marker.read_text())
    process.stop(grace_s=1.0)
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(child, 0)
    assert not process.running()


#: sglang-router's idle-connection timeout: reqwest's pool default, which the router keeps.
ROUTER_IDLE_TIMEOUT_S = 90


def test_servers_keep_idle_connections_longer_than_the_router_does(tmp_path):
    """Else a server may close a connection as the router reuses it: a 502 for a good request
    and its prefill orphaned until the bootstrap timeout."""
    env = ServerEnv(tmp_path, tmp_path / "tmp").for_tp(2)
    assert int(env["SGLANG_TIMEOUT_KEEP_ALIVE"]) == SERVER_KEEP_ALIVE_S > ROUTER_IDLE_TIMEOUT_S


def test_every_started_process_keeps_its_temporary_files_in_the_run_folder(tmp_path):
    """SGLang names its ZMQ sockets after ``tempfile`` files and keeps Prometheus counters in a
    temporary folder; a server ended by signal leaves them in the run's folder, not in /tmp."""
    env = ServerEnv(tmp_path / "site", tmp_path / "tmp")
    made = tmp_path / "made.txt"
    body = f"import pathlib, tempfile, time; pathlib.Path({str(made)!r}).write_text(tempfile.mkstemp()[1]); time.sleep(60)"
    for name, environment in (("plain", env.plain()), ("server", env.for_tp(1))):
        process = ManagedProcess(name, [sys.executable, "-c", body], environment, tmp_path / f"{name}.log", made.exists, 30.0)
        process.start().wait_ready()
        process.stop(grace_s=1.0)
        assert Path(made.read_text()).parent == tmp_path / "tmp", name
        made.unlink()


def _logged(tmp_path: Path, name: str, lines) -> ManagedProcess:
    process = _python(tmp_path, name, "pass")
    process.log_path.write_text("".join(f"{line}\n" for line in lines))
    return process


def test_log_errors_see_the_routers_coloured_level_and_pd_failures(tmp_path):
    router = _logged(tmp_path, "router", ["\x1b[2m10:00\x1b[0m \x1b[31mERROR\x1b[0m pd_router: Decode request failed", "INFO ok"])
    decode = _logged(tmp_path, "decode", ["with exception KVTransferError(bootstrap_room=1): timed out", "ERRORS: 0"])
    assert log_errors(router) == ["router: 10:00 ERROR pd_router: Decode request failed"]
    assert log_errors(decode) == ["decode: with exception KVTransferError(bootstrap_room=1): timed out"]


def test_errors_since_marks_cover_every_process_and_a_restarted_one_from_its_start(tmp_path):
    cluster = ServingCluster(tmp_path / "run", tmp_path / "model")
    old = cluster.processes["decode"] = _logged(tmp_path, "decode", ["ERROR before"])
    cluster.processes["router"] = _logged(tmp_path, "router", ["ERROR before"])
    marks = cluster.log_marks()
    cluster.processes["router"].log_path.write_text("ERROR before\nERROR during\n")
    cluster.processes["decode"] = _logged(tmp_path / "run", "decode", ["ERROR restarted"])
    assert cluster.processes["decode"] is not old
    assert cluster.errors_since(marks) == ["decode: ERROR restarted", "router: ERROR during"]


def test_a_process_that_dies_before_ready_names_itself_with_its_log_tail(tmp_path):
    process = _python(tmp_path, "dies", "print('no model here'); raise SystemExit(3)", ready=lambda: False).start()
    with pytest.raises(ProcessDied, match=r"dies exited with 3(.|\n)*no model here"):
        process.wait_ready()
    process.stop()


def test_readiness_is_bounded(tmp_path):
    process = _python(tmp_path, "slow", "import time; time.sleep(60)", ready=lambda: False, within=0.5).start()
    started = time.monotonic()
    with pytest.raises(NotReady, match="slow not ready after 0 s"):
        process.wait_ready(poll_s=0.1)
    assert time.monotonic() - started < 5
    process.stop(grace_s=1.0)


# --------------------------------------------------------------------- CPU runtime
class _Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def test_runtime_applies_steps_in_order_and_logs_them_in_one_line():
    applied = []
    runtime = ServerRuntime("9.9", [RuntimeStep("first thing", lambda: applied.append(1)), RuntimeStep("second", lambda: applied.append(2))])
    logger, handler = logging.getLogger("sglang_cp_hicache.cpu_server_runtime"), _Lines()
    logger.addHandler(handler)
    try:
        runtime.install()
    finally:
        logger.removeHandler(handler)
    assert applied == [1, 2]
    lines = [line for line in handler.lines if "CPU server runtime" in line]
    assert len(lines) == 1 and "sglang 9.9" in lines[0] and lines[0].endswith("first thing; second")


def test_a_failing_step_is_named():
    def broken() -> None:
        raise KeyError("flash_mla")

    with pytest.raises(RuntimeError, match="step 'read-path stand-ins' failed"):
        ServerRuntime("9.9", [RuntimeStep("read-path stand-ins", broken)]).install()


def test_site_folder_installs_the_runtime_only_when_asked(tmp_path):
    text = (write_site_folder(tmp_path) / "sitecustomize.py").read_text()
    assert 'os.environ.get("SGLANG_CP_HICACHE_CPU_SERVER_RUNTIME") == "1"' in text
    assert "install_server_runtime()" in text


def test_cpu_event_timing_follows_cuda_rules():
    start, end = CpuEvent(CPU_DEVICE_MODULE, enable_timing=True), CpuEvent(CPU_DEVICE_MODULE, enable_timing=True)
    start.record()
    time.sleep(0.01)
    end.record()
    assert 5.0 < start.elapsed_time(end) < 1000.0
    with pytest.raises(RuntimeError, match="enable_timing"):
        CpuEvent(CPU_DEVICE_MODULE).elapsed_time(end)
    with pytest.raises(RuntimeError, match="recorded"):
        start.elapsed_time(CpuEvent(CPU_DEVICE_MODULE, enable_timing=True))


# ---------------------------------------------------------------- sgl_kernel stand-in
def test_stand_in_bodies_and_named_refusals():
    module = sgl_kernel_stand_in.stand_in_module(["copy_all_layer_kv_cache_cpu"])
    req_to_token = torch.zeros(3, 8, dtype=torch.int32)
    module.assign_req_to_token_pool_cpu(
        torch.tensor([2, 0]), req_to_token, torch.tensor([1, 4]), torch.tensor([3, 6]), torch.tensor([7, 8, 9, 10]), 2
    )
    assert req_to_token[2, 1:3].tolist() == [7, 8] and req_to_token[0, 4:6].tolist() == [9, 10]
    x = torch.randn(2, 8)
    torch.testing.assert_close(module.silu_and_mul(x), torch.nn.functional.silu(x[:, :4]) * x[:, 4:])
    with pytest.raises(sgl_kernel_stand_in.StandInOpNotImplemented, match="copy_all_layer_kv_cache_cpu"):
        module.copy_all_layer_kv_cache_cpu(None, None, None, None)
    assert not hasattr(module, "fused_moe_router_cpu")  # unlisted: missing, as from a real package
    assert module.__path__ == []


def test_stand_in_extends_an_existing_stand_in_and_never_shadows_a_real_package(monkeypatch):
    import types

    existing = types.ModuleType("sgl_kernel")
    setattr(existing, sgl_kernel_stand_in.STAND_IN_MARK, True)
    existing.kvcacheio = "kept"
    monkeypatch.setitem(sys.modules, "sgl_kernel", existing)
    module = sgl_kernel_stand_in.install(["verify_tree_greedy_cpu"])
    assert module is existing and module.kvcacheio == "kept" and callable(module.verify_tree_greedy_cpu)
    monkeypatch.setitem(sys.modules, "sgl_kernel", types.ModuleType("sgl_kernel"))
    with pytest.raises(RuntimeError, match="real sgl_kernel"):
        sgl_kernel_stand_in.install([])


# ------------------------------------------------------------------------ checkpoint
def test_checkpoint_is_deterministic_from_its_seed(tmp_path):
    spec = TinyDsaSpec(seed=3, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                       q_lora_rank=32, kv_lora_rank=64, vocab_size=300)  # fmt: skip
    digests = []
    for folder in (tmp_path / "a", tmp_path / "b"):
        folder.mkdir()
        build_checkpoint(spec, folder)
        digests.append(hashlib.sha256((folder / "model.safetensors").read_bytes()).hexdigest())
    assert digests[0] == digests[1]
    other = tmp_path / "c"
    other.mkdir()
    build_checkpoint(TinyDsaSpec(seed=4, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                                 q_lora_rank=32, kv_lora_rank=64, vocab_size=300), other)  # fmt: skip
    assert hashlib.sha256((other / "model.safetensors").read_bytes()).hexdigest() != digests[0]


def test_checkpoint_is_a_glm5_dsa_model_with_random_weights_and_a_local_tokenizer(tmp_path):
    from safetensors import safe_open
    from transformers import AutoConfig, AutoTokenizer

    folder = ensure_checkpoint(TinyDsaSpec(), cache=tmp_path)
    assert ensure_checkpoint(TinyDsaSpec(), cache=tmp_path) == folder  # built once
    config = AutoConfig.from_pretrained(folder)
    assert config.architectures == ["GlmMoeDsaForCausalLM"] and config.index_topk == 128
    assert config.rope_parameters["rope_type"] == "yarn" and config.num_nextn_predict_layers == 1
    with safe_open(folder / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
        std = weights.get_tensor("model.layers.1.self_attn.kv_a_proj_with_mqa.weight").float().std()
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in names  # MoE on layer 1
    assert "model.layers.0.mlp.gate_proj.weight" in names  # layer 0 dense
    assert "model.layers.2.eh_proj.weight" in names  # the NextN (MTP) layer
    assert 0.07 < float(std) < 0.09
    tokenizer = AutoTokenizer.from_pretrained(folder)
    assert len(tokenizer) <= 512 and tokenizer.decode(tokenizer.encode("the quick brown fox")) == "the quick brown fox"


# ---------------------------------------------------------------- metrics and client
def test_metrics_sum_by_name_labels_and_rank():
    text = textwrap.dedent(
        """
        # HELP x
        sglang:kv_transfer_total_mb_sum{tp_rank="0",model_name="m"} 1.5
        sglang:kv_transfer_total_mb_sum{tp_rank="1",model_name="m"} 2.0
        sglang:kv_transfer_total_mb_sum{tp_rank="1",model_name="n"} 0.5
        master_key_count 22
        """
    )
    metrics = Metrics.parse(text)
    assert metrics.per_rank("sglang:kv_transfer_total_mb_sum") == {0: 1.5, 1: 2.5}
    assert metrics.total("sglang:kv_transfer_total_mb_sum", model_name="m") == 3.5
    assert metrics.total("master_key_count") == 22


class _Fake(http.server.BaseHTTPRequestHandler):
    def do_POST(self):  # noqa: N802 (http.server's name)
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if body.get("input_ids") == [9]:
            self.send_response(400)
            self.end_headers()
            self.wfile.write(b'{"error": "too long"}')
            return
        meta = {"prompt_tokens": 3, "cached_tokens": 2, "cached_tokens_details": {"device": 0, "host": 2},
                "output_token_logprobs": [[-1.5, 7, None], [-0.25, 8, None]], "finish_reason": {"type": "length"}}  # fmt: skip
        self.send_response(200)
        self.end_headers()
        if not body["stream"]:
            self.wfile.write(json.dumps({"output_ids": [7, 8], "meta_info": meta}).encode())
            return
        if body.get("input_ids") == [8]:
            self.wfile.write(b'data: {"error": {"message": "context", "code": 400}}\n\n')
            return
        first = {"output_ids": [7], "meta_info": {**meta, "output_token_logprobs": meta["output_token_logprobs"][:1]}}
        for chunk in (first, {"output_ids": [7, 8], "meta_info": meta}):
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")

    def log_message(self, *args):
        pass


@pytest.fixture()
def fake_server(fake_http):
    return fake_http(_Fake)


@pytest.mark.parametrize("stream", [True, False])
def test_generate_reads_ids_logprobs_and_cached_tiers(fake_server, stream):
    completion = generate(fake_server, [1, 2, 3], 2, stream=stream)
    assert completion.output_ids == (7, 8) and completion.logprobs == (-1.5, -0.25)
    assert completion.cached_by_tier == {"device": 0, "host": 2, "storage": 0}
    assert 0 < completion.ttft_s <= completion.e2e_s


def test_generate_raises_with_the_status_of_an_http_or_stream_error(fake_server):
    with pytest.raises(RequestFailed) as http_error:
        generate(fake_server, [9], 2)
    assert http_error.value.status == 400 and "too long" in http_error.value.body
    with pytest.raises(RequestFailed) as stream_error:
        generate(fake_server, [8], 2)
    assert stream_error.value.status == 400
    assert post(fake_server, "/generate", b'{"input_ids": [9], "stream": false}')[0] == 400


# --------------------------------------------------------------- prompts, comparison
def test_scaled_prompts_keep_shared_prefixes_and_fit():
    base = list(range(5000))
    short, long = scaled_prompt(base[:3000], 0.4), scaled_prompt(base, 0.4)
    assert long[: len(short)] == short and abs(len(long) - 2000) <= 1
    assert all(3 <= t < 512 for t in long)


def test_trace_prompts_fit_the_context(tmp_path):
    trace = tmp_path / "t.jsonl"
    trace.write_text(
        '{"session_id": "a", "new_tokens": 3000, "system_prompt": "s", "system_prompt_len": 1000}\n'
        '{"session_id": "a", "new_tokens": 2000, "reply_tokens": 100}\n'
    )
    first, second = trace_prompts(trace)
    assert len(second) <= 2043 and second[: len(first)] == first


class _Router:
    name = "r"


def _completion(ids, logprobs):
    return Completion(tuple(ids), tuple(logprobs), 5, 0, {"device": 0, "host": 0, "storage": 0}, 0.1, 0.2)


def test_recorder_counts_any_id_or_logprob_difference():
    recorder = Recorder.__new__(Recorder)  # bookkeeping only: no session, no server
    recorder.report = ScenarioReport("unit")
    recorder.compare("same", _completion([1, 2], [-1.0, -2.0]), _completion([1, 2], [-1.0, -2.0]))
    assert recorder.report.identical
    recorder.compare("one ulp", _completion([1, 2], [-1.0, -2.0]), _completion([1, 2], [-1.0, -2.0000002]))
    recorder.compare("ids", _completion([1, 3], [-1.0, -2.0]), _completion([1, 2], [-1.0, -2.0]))
    assert len(recorder.report.mismatches) == 2 and not recorder.report.ok
    assert recorder.report.max_logprob_diff == pytest.approx(2e-7, rel=0.5)


# ------------------------------------------------------------------------ KV events
@pytest.mark.parametrize("line", [LAUNCH_0512, LAUNCH_0523], ids=lambda line: line.release)
def test_kv_events_publisher_only_where_asked_and_the_scenario_only_where_the_line_publishes(line):
    spec = PrefillSpec("p", tp=2)
    plain = prefill_argv(line, Path("m"), Endpoint(1, 2), spec)
    assert "--kv-events-config" not in plain
    argv = prefill_argv(line, Path("m"), Endpoint(1, 2, 5557), spec)
    config = json.loads(argv[argv.index("--kv-events-config") + 1])
    assert config == {"publisher": "zmq", "endpoint": "tcp://127.0.0.1:5557", "bind": True}
    assert ("kv_events" in {s.name for s in scenarios_for(line)}) == line.publishes_kv_events
    assert line.publishes_kv_events == (line.release == "0.5.23")
