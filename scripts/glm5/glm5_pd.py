"""GLM-5 PD disaggregation with CP shared KV + HiCache: launch, workloads, hit rates.

One node with 16 GPUs (prefill on 0-7, decode on 8-15), or two 8-GPU nodes
(``--nodes 2``: decode on GPUs 0-7 of the second node, started there with
``glm5_pd.py decode --nodes 2 --host <prefill ip> --decode-host <decode ip>``; the workloads on
the prefill node then launch prefill + router only and wait for the remote decode;
``--host``/``--decode-host`` must be routable addresses, ``--ib-device`` names the RDMA NIC
for Mooncake). Needs the zai-org/GLM-5-FP8 weights, ``mooncake-transfer-engine`` and
``sglang-router`` (checked up front). Subcommands:

* ``prefill`` / ``decode`` / ``router``: run one component in the foreground, its output
  also in ``<log-dir>/<name>.log``; the prefill one prints hit rates every
  ``--report-interval`` seconds; on exit the log is scanned and errors fail the script;
* ``repeated-prefix``: launch all three, send rounds of requests
  over more distinct long prefixes than the prefill device pool holds, so revisits are
  served by host load-back; print hit rates from the prefill server's metrics; fail on
  request errors, errors in the logs, or no host hits. Probe prompts (a prefix + a fixed
  suffix) are sent cold, again at once (device hit) and in later rounds (host hit); their
  greedy outputs and first-token logprobs must agree, else the run fails;
* ``host-pressure``: the same with a small ``--hicache-size`` so the host pool evicts too;
* ``metrics``: print hit rates of a running prefill server.

``--no-launch``: start no server at all; check that the endpoints are up (``/health``) and run
the checks against them: the workloads need a running prefill, decode and router (on any
hosts: ``--host``/``--decode-host`` only name the endpoints, so the two-node launch checks do
not apply); ``prefill``/``decode``/``router --no-launch`` check that component's endpoint
(prefill: and print its hit rates). Remote decode *with* a launch is ``--nodes 2``.

Every subcommand takes ``--dry-run``: print the commands (and the workload plan) only.

``--sglang 0.5.23``: the prefill server spelled for SGLang 0.5.23 (``--enable-prefill-cp
--cp-strategy interleave`` instead of 0.5.12's removed ``--enable-nsa-prefill-context-parallel``,
page 64, kernel HiCache I/O as 0.5.23's sharded DSA HiCache requires) for H200: the KV dtype
resolves to bf16 (``flashmla_sparse`` prefill) unless ``--kv-cache-dtype fp8_e4m3``
(``flashmla_kv``), the two Hopper formats the plugin admits. Default 0.5.12 (its spelling).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterator, List, Optional, Sequence

MODEL = "zai-org/GLM-5-FP8"
ENV = {"SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER": "1"}
LOG_ERROR_PATTERNS = (
    r"Traceback \(most recent call last\)",
    r"\bERROR\b",
    r"CUDA error",
    r"SharedKVUnsupportedPath",
    r"SharedKVSelfTestFailed",
    r"KVTransferError",
    r"out of memory",
)


@dataclass(frozen=True)
class Deployment:
    model: str = MODEL
    host: str = "127.0.0.1"
    decode_host: str = "127.0.0.1"
    prefill_port: int = 30000
    decode_port: int = 30001
    bootstrap_port: int = 8998
    router_port: int = 8000
    tp: int = 8
    decode_base_gpu: int = 8
    nodes: int = 1
    hicache_ratio: float = 2.0
    hicache_size_gb: int = 0  # per rank; 0 = use the ratio
    ib_device: Optional[str] = None
    log_dir: str = "glm5_pd_logs"
    sglang: str = "0.5.12"  # the SGLang line the prefill server is spelled for
    kv_cache_dtype: Optional[str] = None  # None: SGLang's default (bf16 on H200 with 0.5.23)

    @property
    def prefill_url(self) -> str:
        return f"http://{self.host}:{self.prefill_port}"

    @property
    def decode_url(self) -> str:
        return f"http://{self.decode_host}:{self.decode_port}"

    @property
    def router_url(self) -> str:
        return f"http://{self.host}:{self.router_port}"


SGLANG_LINES = ("0.5.12", "0.5.23")
# Prefill CP with shared KV, per SGLang line: 0.5.23 renamed prefill CP without an alias
# (the plugin still accepts 0.5.12's spelling under its flag, with a deprecation warning).
PREFILL_CP_FLAGS = {
    "0.5.12": ["--enable-nsa-prefill-context-parallel", "--enable-nsa-prefill-cp-shared-kv"],
    "0.5.23": [
        "--enable-prefill-cp", "--cp-strategy", "interleave", "--enable-nsa-prefill-cp-shared-kv",
        # Kernel I/O: the plugin backs up layer by layer during the forward into 0.5.23's
        # default host layout (page_first) through the JIT one-layer kernel.
        "--page-size", "64", "--hicache-io-backend", "kernel",
    ],
}


def prefill_command(d: Deployment) -> List[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", d.model, "--trust-remote-code",
        "--tp", str(d.tp),
        *PREFILL_CP_FLAGS[d.sglang],
        "--enable-hierarchical-cache",
        "--disaggregation-mode", "prefill", "--disaggregation-transfer-backend", "mooncake",
        "--disaggregation-bootstrap-port", str(d.bootstrap_port),
        "--host", d.host, "--port", str(d.prefill_port),
        "--enable-metrics", "--enable-cache-report",
    ]
    cmd += ["--hicache-size", str(d.hicache_size_gb)] if d.hicache_size_gb else ["--hicache-ratio", str(d.hicache_ratio)]
    if d.kv_cache_dtype:
        cmd += ["--kv-cache-dtype", d.kv_cache_dtype]
    if d.ib_device:
        cmd += ["--disaggregation-ib-device", d.ib_device]
    return cmd


def decode_command(d: Deployment) -> List[str]:
    cmd = [
        sys.executable, "-m", "sglang.launch_server", "--model-path", d.model, "--trust-remote-code",
        "--tp", str(d.tp), "--base-gpu-id", str(d.decode_base_gpu),
        "--disaggregation-mode", "decode", "--disaggregation-transfer-backend", "mooncake",
        "--host", d.decode_host, "--port", str(d.decode_port), "--enable-metrics",
    ]
    if d.ib_device:
        cmd += ["--disaggregation-ib-device", d.ib_device]
    return cmd


def router_command(d: Deployment) -> List[str]:
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        "--prefill", d.prefill_url, str(d.bootstrap_port),
        "--decode", d.decode_url,
        "--host", d.host, "--port", str(d.router_port),
    ]


_LOOPBACK = ("127.0.0.1", "localhost", "::1", "0.0.0.0")


def topology_problems(d: Deployment) -> List[str]:
    """Two nodes need addresses the other node (and the router) can reach."""
    if d.nodes == 1:
        return []
    problems = []
    if d.nodes != 2:
        problems.append(f"--nodes {d.nodes}: 1 (16 GPUs) or 2 (two 8-GPU nodes)")
    for flag, host in (("--host", d.host), ("--decode-host", d.decode_host)):
        if host in _LOOPBACK:
            problems.append(f"--nodes 2 needs a routable {flag} (the other node connects to it), got {host}")
    if d.host == d.decode_host:
        problems.append("--nodes 2: --host and --decode-host are the same address")
    return problems


# Python module -> pip package, for the components that need it.
_DEPENDENCIES = {"mooncake": "mooncake-transfer-engine", "sglang_router": "sglang-router"}
_COMPONENT_NEEDS = {"prefill": ("mooncake",), "decode": ("mooncake",), "router": ("sglang_router",)}


def missing_dependencies(components: Sequence[str]) -> List[str]:
    """``pip install`` names of the modules the components need and this Python lacks."""
    import importlib.util

    needed = dict.fromkeys(m for c in components for m in _COMPONENT_NEEDS.get(c, ()))
    return [_DEPENDENCIES[m] for m in needed if importlib.util.find_spec(m) is None]


def dependency_message(missing: Sequence[str]) -> str:
    return (
        f"missing {', '.join(missing)}: PD disaggregation needs them next to sglang "
        f"(pip install {' '.join(missing)})"
    )


def shell_line(cmd: Sequence[str], env: Dict[str, str]) -> str:
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(c) for c in cmd])


# -------------------------------------------------------------------- workload
@dataclass(frozen=True)
class Workload:
    """Rounds over distinct random-token prefixes; each request = prefix + short suffix.

    ``num_prefixes * prefix_tokens`` should exceed the prefill device KV capacity so later
    rounds find their prefix only in the host cache.
    """

    num_prefixes: int
    prefix_tokens: int = 32768
    suffix_tokens: int = 64
    rounds: int = 3
    max_new_tokens: int = 8
    vocab_low: int = 1000
    vocab_high: int = 100000
    seed: int = 0

    def _tokens(self, seed: int, count: int) -> List[int]:
        rng = random.Random(seed)
        return [rng.randrange(self.vocab_low, self.vocab_high) for _ in range(count)]

    def requests(self) -> Iterator[List[int]]:
        """Round-robin over the prefixes, so a prefix returns only after all others."""
        for round_index in range(self.rounds):
            for prefix_index in range(self.num_prefixes):
                prefix = self._tokens(self.seed * 1_000_003 + prefix_index, self.prefix_tokens)
                suffix_seed = (self.seed * 1_000_003 + prefix_index) * 101 + round_index + 1
                yield prefix + self._tokens(-suffix_seed, self.suffix_tokens)

    def describe(self) -> str:
        total = self.num_prefixes * self.prefix_tokens
        return (
            f"workload: {self.rounds} rounds x {self.num_prefixes} prefixes of {self.prefix_tokens} tokens "
            f"(+{self.suffix_tokens} suffix, {self.max_new_tokens} new tokens); {total} distinct prefix tokens"
        )


    def probe(self, prefix_index: int) -> List[int]:
        """A fixed prompt per prefix (prefix + probe suffix), the same in every round."""
        prefix = self._tokens(self.seed * 1_000_003 + prefix_index, self.prefix_tokens)
        return prefix + self._tokens(-(self.seed * 1_000_003 + prefix_index) * 101, self.suffix_tokens)


@dataclass(frozen=True)
class ProbeOutput:
    """One probe response: greedy output ids, first output token's logprob, cached tokens."""

    kind: str  # cold | device | host (what the schedule aims at; cached_tokens says what happened)
    output_ids: tuple
    first_logprob: float
    cached_tokens: int


def parse_probe(kind: str, response: dict) -> ProbeOutput:
    meta = response.get("meta_info", {})
    logprobs = meta.get("output_token_logprobs") or []
    ids = response.get("output_ids") or [entry[1] for entry in logprobs]
    first = float(logprobs[0][0]) if logprobs else float("nan")
    return ProbeOutput(kind, tuple(ids), first, int(meta.get("cached_tokens", 0)))


def probe_divergences(outputs: Sequence[ProbeOutput], logprob_tol: float) -> List[str]:
    """Every way the device-hit / host-hit outputs differ from the cold one."""
    cold = next((o for o in outputs if o.kind == "cold"), None)
    if cold is None:
        return ["no cold probe output"]
    problems = []
    for out in outputs:
        if out is cold:
            continue
        if out.output_ids != cold.output_ids:
            problems.append(f"{out.kind}-hit greedy output {list(out.output_ids)} != cold {list(cold.output_ids)}")
        if not abs(out.first_logprob - cold.first_logprob) <= logprob_tol:
            problems.append(
                f"{out.kind}-hit first-token logprob {out.first_logprob:.5f} vs cold {cold.first_logprob:.5f} "
                f"(tolerance {logprob_tol})"
            )
        if out.cached_tokens == 0:
            problems.append(f"{out.kind}-hit probe had no cached tokens")
    return problems


def auto_num_prefixes(device_tokens: float, prefix_tokens: int, factor: float) -> int:
    """Enough distinct prefixes for ``factor`` times the device KV capacity (in tokens)."""
    return max(2, math.ceil(factor * device_tokens / prefix_tokens))


def generate(url: str, input_ids: List[int], max_new_tokens: int, timeout_s: float, logprobs: bool = False) -> dict:
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}
    if logprobs:
        payload["return_logprob"] = True
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        if response.status != 200:
            raise RuntimeError(f"HTTP {response.status}")
        return json.loads(response.read().decode())


def send_workload(
    url: str, workload: Workload, timeout_s: float = 600.0, probes: int = 0, logprob_tol: float = 0.02
) -> List[str]:
    """POST every request to ``/generate``; return the error messages.

    The first ``probes`` prefixes also get their probe prompt: cold and again at once
    (device hit) before the prefix's first request, then once per later round (host hit,
    every other prefix having been served in between). Divergent outputs are errors.
    """
    errors: List[str] = []
    probe_outputs: Dict[int, List[ProbeOutput]] = {}

    def probe(prefix_index: int, kind: str) -> None:
        try:
            response = generate(url, workload.probe(prefix_index), workload.max_new_tokens, timeout_s, logprobs=True)
            probe_outputs.setdefault(prefix_index, []).append(parse_probe(kind, response))
        except Exception as exc:
            errors.append(f"probe {prefix_index} ({kind}): {type(exc).__name__}: {exc}")

    for i, input_ids in enumerate(workload.requests()):
        round_index, prefix_index = divmod(i, workload.num_prefixes)
        if prefix_index < probes:
            for kind in (("cold", "device") if round_index == 0 else ("host",)):
                probe(prefix_index, kind)
        try:
            generate(url, input_ids, workload.max_new_tokens, timeout_s)
        except Exception as exc:  # report, keep going: the hit rates are still informative
            errors.append(f"request {i}: {type(exc).__name__}: {exc}")
    for prefix_index, outputs in sorted(probe_outputs.items()):
        errors += [f"probe {prefix_index}: {p}" for p in probe_divergences(outputs, logprob_tol)]
    return errors


# --------------------------------------------------------------------- metrics
_SAMPLE = re.compile(r"^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$")


def parse_prometheus(text: str) -> List[tuple]:
    """``(name, labels, value)`` of every sample line."""
    samples = []
    for line in text.splitlines():
        match = _SAMPLE.match(line.strip())
        if match and not line.startswith("#"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
            samples.append((match.group("name"), labels, float(match.group("value"))))
    return samples


@dataclass(frozen=True)
class HitRates:
    prompt_tokens: float
    cached: Dict[str, float] = field(default_factory=dict)

    def rate(self, source: str) -> float:
        cached = self.cached.get(source)
        if cached is None and source == "total":  # 0.5.23 reports per source only
            cached = sum(v for s, v in self.cached.items() if s != "total")
        return (cached or 0.0) / self.prompt_tokens if self.prompt_tokens else 0.0

    def line(self) -> str:
        return (
            f"hit rates: total {self.rate('total'):.1%}, device {self.rate('device'):.1%}, "
            f"host {self.rate('host'):.1%} (prompt tokens {self.prompt_tokens:.0f})"
        )


def device_capacity_tokens(metrics_text: str) -> float:
    """The prefill's logical device capacity in tokens, max over ranks: 0.5.12's plugin reports
    it as ``sglang:max_total_num_tokens``; 0.5.23's native sharding reports a rank's physical
    tokens there and the logical pool as free + in use + cached (``sglang:kv_available_tokens``
    + ``kv_used_tokens`` + ``kv_evictable_tokens``)."""
    per_rank: Dict[str, Dict[str, float]] = {}
    for name, labels, value in parse_prometheus(metrics_text):
        per_rank.setdefault(labels.get("tp_rank", ""), {})[name] = value
    values = [
        max(m.get("sglang:max_total_num_tokens", 0.0),
            sum(m.get(f"sglang:kv_{part}_tokens", 0.0) for part in ("available", "used", "evictable")))  # fmt: skip
        for m in per_rank.values()
        if "sglang:max_total_num_tokens" in m
    ]
    if not values:
        raise RuntimeError("sglang:max_total_num_tokens missing from /metrics (is --enable-metrics on?)")
    return max(values)


def hit_rates(metrics_text: str) -> HitRates:
    """Prompt-token hit rates by cache source, summed over the server's ranks."""
    prompt, cached = 0.0, {}
    for name, labels, value in parse_prometheus(metrics_text):
        if name == "sglang:prompt_tokens_total":
            prompt += value
        elif name == "sglang:cached_tokens_total":
            source = labels.get("cache_source", "total")
            cached[source] = cached.get(source, 0.0) + value
    return HitRates(prompt, cached)


def fetch_metrics(url: str) -> str:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        return response.read().decode()


def log_errors(paths: Sequence[Path]) -> List[str]:
    """``file:line: text`` of every log line matching an error pattern."""
    pattern = re.compile("|".join(LOG_ERROR_PATTERNS))
    found = []
    for path in paths:
        if path.exists():
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    found.append(f"{path.name}:{number}: {line.strip()[:200]}")
    return found


# -------------------------------------------------------------------- running
def _wait_healthy(url: str, timeout_s: float) -> bool:
    """``GET url/health`` until it answers 200 or ``timeout_s`` passes (tried at least once)."""
    deadline = time.time() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as response:
                if response.status == 200:
                    return True
        except Exception:
            pass
        if time.time() >= deadline:
            return False
        time.sleep(min(5.0, max(deadline - time.time(), 0.0)))


def component_url(d: Deployment, name: str) -> str:
    return {"prefill": d.prefill_url, "decode": d.decode_url, "router": d.router_url}[name]


def running_endpoint_problems(d: Deployment, names: Sequence[str], timeout_s: float) -> List[str]:
    """``--no-launch``: one line per component whose endpoint is not healthy."""
    return [
        f"{name} at {component_url(d, name)} is not healthy (--no-launch uses running servers: start it first)"
        for name in names
        if not _wait_healthy(component_url(d, name), timeout_s)
    ]


class Launched:
    """Background components with logs; stopped (process group) on exit."""

    def __init__(self, log_dir: Path):
        self.log_dir = log_dir
        self.procs: List[subprocess.Popen] = []
        self.logs: List[Path] = []

    def start(self, name: str, cmd: Sequence[str]) -> None:
        log = self.log_dir / f"{name}.log"
        self.logs.append(log)
        env = {**os.environ, **ENV}
        with open(log, "w") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        for proc in self.procs:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)


def run_component(name: str, cmd: Sequence[str], env: Dict[str, str], d: Deployment, report_interval_s: float) -> int:
    """Foreground component: tee output to its log, report hit rates (prefill), scan the log."""
    log_dir = Path(d.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"{name}.log"
    stop = threading.Event()

    def report() -> None:
        while not stop.wait(report_interval_s):
            try:
                print(hit_rates(fetch_metrics(d.prefill_url)).line(), flush=True)
            except Exception as exc:  # server still starting or already gone
                print(f"hit rates unavailable: {exc}", flush=True)

    if name == "prefill" and report_interval_s > 0:
        threading.Thread(target=report, daemon=True).start()
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env={**os.environ, **env}, text=True)
        try:
            for line in proc.stdout:
                sys.stdout.write(line)
                out.write(line)
        except KeyboardInterrupt:
            proc.send_signal(signal.SIGINT)
        rc = proc.wait()
    stop.set()
    errors = log_errors([log])
    for error in errors[:20]:
        print(f"error: {error}")
    print(f"{'FAIL' if errors or rc else 'PASS'} {name} exited {rc}, {len(errors)} error lines in {log}")
    return 1 if errors or rc else 0


def run_workload(
    d: Deployment, workload: Workload, factor: float, launch: bool, startup_timeout_s: float,
    probes: int = 0, logprob_tol: float = 0.02,
) -> int:
    log_dir = Path(d.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    launched = Launched(log_dir)
    try:
        if not launch:
            problems = running_endpoint_problems(d, WORKLOAD_ENDPOINTS, NO_LAUNCH_HEALTH_TIMEOUT_S)
            if problems:
                for problem in problems:
                    print(f"error: {problem}")
                print(f"FAIL {len(problems)} endpoints not healthy")
                return 1
        else:
            launched.start("prefill", prefill_command(d))
            if d.nodes == 1:
                launched.start("decode", decode_command(d))
            else:
                print(f"waiting for the remote decode server at {d.decode_url}")
            if not (_wait_healthy(d.prefill_url, startup_timeout_s) and _wait_healthy(d.decode_url, startup_timeout_s)):
                print(f"FAIL servers not healthy after {startup_timeout_s:.0f} s; logs in {log_dir}")
                return 1
            launched.start("router", router_command(d))
            if not _wait_healthy(d.router_url, 120):
                print(f"FAIL router not healthy; logs in {log_dir}")
                return 1
        if workload.num_prefixes == 0:
            capacity = device_capacity_tokens(fetch_metrics(d.prefill_url))
            workload = dataclasses.replace(
                workload, num_prefixes=auto_num_prefixes(capacity, workload.prefix_tokens, factor)
            )
            print(f"prefill device capacity {capacity:.0f} tokens; {factor}x that in distinct prefixes")
        print(workload.describe())
        errors = send_workload(d.router_url, workload, probes=probes, logprob_tol=logprob_tol)
        rates = hit_rates(fetch_metrics(d.prefill_url))
        print(rates.line())
        errors += log_errors(launched.logs)
        if rates.cached.get("host", 0.0) <= 0:
            errors.append("no host cache hits: the workload did not exercise device eviction + host load-back")
    finally:
        launched.stop()
    for error in errors[:20]:
        print(f"error: {error}")
    print(f"{'FAIL' if errors else 'PASS'} {len(errors)} errors")
    return 1 if errors else 0


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=("prefill", "decode", "router", "repeated-prefix", "host-pressure", "metrics"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--model-path", default=MODEL)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--decode-host", default="127.0.0.1")
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--decode-base-gpu", type=int, default=None, help="default: 8 (one node), 0 (--nodes 2)")
    parser.add_argument("--nodes", type=int, choices=(1, 2), default=1,
                        help="2: decode on a second 8-GPU node (start it there; workloads here do not launch it)")
    parser.add_argument("--probes", type=int, default=2, help="repeated-prefix: prefixes probed cold/device/host")
    parser.add_argument("--logprob-tol", type=float, default=0.02, help="probes: first-token logprob tolerance")
    parser.add_argument("--hicache-ratio", type=float, default=2.0)
    parser.add_argument("--hicache-size", type=int, default=0, help="GB per rank (0: use the ratio)")
    parser.add_argument("--ib-device", default=None)
    parser.add_argument("--log-dir", default="glm5_pd_logs")
    parser.add_argument("--sglang", choices=SGLANG_LINES, default="0.5.12",
                        help="the SGLang line the prefill server is spelled for")
    parser.add_argument("--kv-cache-dtype", choices=("bfloat16", "fp8_e4m3"), default=None,
                        help="prefill KV dtype (default: SGLang's; 0.5.23 on H200: bfloat16)")
    parser.add_argument("--no-launch", action="store_true",
                        help="launch nothing: check the running endpoints (/health) and run the checks against them")
    parser.add_argument("--num-prefixes", type=int, default=0, help="0: sized from the server's capacity")
    parser.add_argument("--prefix-tokens", type=int, default=32768)
    parser.add_argument("--suffix-tokens", type=int, default=64)
    parser.add_argument("--token-ids", default="1000:100000",
                        help="LOW:HIGH, the range workload token ids are drawn from (a smaller model: its vocabulary)")
    parser.add_argument("--prefill-port", type=int, default=30000)
    parser.add_argument("--decode-port", type=int, default=30001)
    parser.add_argument("--bootstrap-port", type=int, default=8998)
    parser.add_argument("--router-port", type=int, default=8000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--startup-timeout", type=float, default=1800.0)
    parser.add_argument("--report-interval", type=float, default=300.0, help="prefill: seconds between hit-rate lines")
    return parser.parse_args(argv)


# Distinct prefix tokens as a multiple of the prefill device capacity: revisits must load
# back from host; under host pressure the host pool (small --hicache-size) must evict too.
REPEATED_PREFIX_FACTOR = 1.5
HOST_PRESSURE_FACTOR = 3.0
# Per rank. HiCache needs the host pool larger than the device pool; raise it if startup
# says so. The workload then needs about three times the device pool.
HOST_PRESSURE_HICACHE_GB = 40
# --no-launch: the endpoints a workload talks to, and how long each may take to answer.
WORKLOAD_ENDPOINTS = ("prefill", "decode", "router")
NO_LAUNCH_HEALTH_TIMEOUT_S = 30.0


def check_running_component(d: Deployment, name: str, dry_run: bool) -> int:
    """``<component> --no-launch``: the running endpoint is healthy (prefill: hit rates too)."""
    url = component_url(d, name)
    if dry_run:
        print(f"no launch: GET {url}/health" + (f"; GET {url}/metrics -> hit rates" if name == "prefill" else ""))
        return 0
    problems = running_endpoint_problems(d, [name], NO_LAUNCH_HEALTH_TIMEOUT_S)
    if not problems and name == "prefill":
        print(hit_rates(fetch_metrics(url)).line())
    for problem in problems:
        print(f"error: {problem}")
    print(f"{'FAIL' if problems else 'PASS'} {name} at {url}")
    return 1 if problems else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    hicache_size = args.hicache_size
    factor = REPEATED_PREFIX_FACTOR
    if args.command == "host-pressure":
        hicache_size = hicache_size or HOST_PRESSURE_HICACHE_GB
        factor = HOST_PRESSURE_FACTOR
    decode_base_gpu = args.decode_base_gpu if args.decode_base_gpu is not None else (8 if args.nodes == 1 else 0)
    d = Deployment(
        model=args.model_path, host=args.host, decode_host=args.decode_host, tp=args.tp,
        decode_base_gpu=decode_base_gpu, nodes=args.nodes, hicache_ratio=args.hicache_ratio,
        hicache_size_gb=hicache_size, ib_device=args.ib_device, log_dir=args.log_dir,
        sglang=args.sglang, kv_cache_dtype=args.kv_cache_dtype, prefill_port=args.prefill_port,
        decode_port=args.decode_port, bootstrap_port=args.bootstrap_port, router_port=args.router_port,
    )
    # Only a launch needs the two-node topology; --no-launch just names endpoints.
    problems = [] if args.no_launch else topology_problems(d)
    if problems:
        print(f"FAIL {'; '.join(problems)}")
        return 2
    launches = not args.no_launch
    components = [args.command] if args.command in ("prefill", "decode", "router") and launches else []
    if args.command in ("repeated-prefix", "host-pressure") and launches:
        components = ["prefill", "router"] + (["decode"] if d.nodes == 1 else [])
    missing = missing_dependencies(components)
    if missing and not args.dry_run:
        print(f"FAIL {dependency_message(missing)}")
        return 2
    if missing:
        print(f"note: {dependency_message(missing)}")
    low, high = (int(part) for part in args.token_ids.split(":"))
    workload = Workload(
        num_prefixes=args.num_prefixes, prefix_tokens=args.prefix_tokens, suffix_tokens=args.suffix_tokens,
        rounds=args.rounds, vocab_low=low, vocab_high=high,
    )
    single = {"prefill": prefill_command, "decode": decode_command, "router": router_command}
    if args.command in single and args.no_launch:
        return check_running_component(d, args.command, args.dry_run)
    if args.command in single:
        cmd = single[args.command](d)
        env = ENV if args.command != "router" else {}
        print(shell_line(cmd, env))
        if args.dry_run:
            return 0
        return run_component(args.command, cmd, env, d, args.report_interval)
    if args.command == "metrics":
        if args.dry_run:
            print(f"GET {d.prefill_url}/metrics")
            return 0
        print(hit_rates(fetch_metrics(d.prefill_url)).line())
        return 0
    if args.dry_run:
        if args.no_launch:
            print("no launch: " + "; ".join(f"GET {component_url(d, n)}/health" for n in WORKLOAD_ENDPOINTS))
        else:
            for name, builder in single.items():
                if name == "decode" and d.nodes == 2:
                    print(f"decode: remote, on the decode node: {shell_line(builder(d), ENV)}")
                    continue
                print(f"{name}: {shell_line(builder(d), ENV if name != 'router' else {})}")
        if args.command == "repeated-prefix" and args.probes:
            print(f"probes: {args.probes} prefixes x (cold, device hit, host hit per later round); "
                  f"greedy outputs equal, first-token logprob within {args.logprob_tol}")
        if workload.num_prefixes == 0:
            print(f"prefixes: {factor}x sglang:max_total_num_tokens from {d.prefill_url}/metrics, "
                  f"{workload.prefix_tokens} tokens each")
        else:
            print(workload.describe())
        print(f"POST {d.router_url}/generate ({workload.rounds} rounds); GET {d.prefill_url}/metrics -> hit rates")
        return 0
    probes = args.probes if args.command == "repeated-prefix" else 0
    return run_workload(
        d, workload, factor, launch=not args.no_launch, startup_timeout_s=args.startup_timeout,
        probes=probes, logprob_tol=args.logprob_tol,
    )


if __name__ == "__main__":
    sys.exit(main())
