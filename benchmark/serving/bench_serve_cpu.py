"""The CPU PD cluster under SGLang's own client: sharded vs unsharded at the same per-rank memory.

Starts the serving harness's PD cluster (``testing/server/``: one decode, one router per
prefill) with three prefills of the tiny GLM-5 DSA model, every one tp 2 (= cp 2) with
HiCache (host pool 4x the device pool) and an L3 file tier of its own:

* **a** ``sharded``: the plugin's flag; a logical device pool of 4096 tokens, 2048 per rank;
* **b** ``unsharded-half``: no flag, the same per-rank device and host memory as a (2048
  device tokens per rank = 2048 logical: half a's capacity, what a user has without the flag);
* **c** ``reference``: no flag, a's logical capacity (4096): the equivalence control.

Each workload (``testing/server/bench_workloads.py``: ``generated-shared-prefix`` sized so its
working set exceeds b's device pool and fits a's; multi-turn conversations in the Mooncake
trace format) runs at every concurrency through each router with
``python -m sglang.bench_serving --backend sglang`` (a subprocess; ``testing/server/bench_run.py``),
the configurations one after the other per cell (a, b, c, their order rotated every cell so
each goes first in turn, then c again for its own run-to-run spread), every prefill warmed up
once, its device and host tiers flushed before each run, and every run under its own
``extra_key`` (no run reuses another's pages, L3 included). Printed per configuration: request and input-token throughput, TTFT
p50/p90/p99, hit tokens by tier (bench_serving's ``cached_tokens_details`` sums and the
prefill's ``sglang:cached_tokens_total``), the ratios a/b and a/c of the same repeats, the
targets, and the greedy outputs compared request by request (a vs c against c vs its rerun).
JSON and a PNG (TTFT CDF, hits by tier) where asked. Exit 1 on a failed request, on a run
whose requests the decode did not finish with all their tokens (an empty success), on a failed
or empty post-flush probe, or where the greedy criterion fails; the speed and hit targets are
reported, never asserted.

    scripts/bench_serve_cpu.sh                      # the full matrix (about 30 min on 2 busy cores)
    scripts/bench_serve_cpu.sh --quick              # concurrency 4, smaller workloads (a smoke run)
    scripts/bench_serve_cpu.sh --json out/serving.json --png out/serving.png --repeats 2
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from serving_report import PROBE_TOKENS, ConfigRun, Report, write_png

from sglang_cp_hicache.testing.server.bench_run import BenchTarget, Workload, run_bench
from sglang_cp_hicache.testing.server.bench_workloads import Conversations, shared_prefix, warm_up_prompts
from sglang_cp_hicache.testing.server.client import TIERS, RequestFailed, generate, post
from sglang_cp_hicache.testing.server.cluster import Router, Server
from sglang_cp_hicache.testing.server.launch import LOGICAL_TOKENS, PrefillSpec
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.session import ServingSession, l3_file_tier
from sglang_cp_hicache.testing.server.tiny_model import ensure_checkpoint

HALF = "unsharded-half"
#: configuration -> (what it is, its logical device tokens)
CONFIGS = {
    "a": ("sharded, flag + HiCache", LOGICAL_TOKENS),
    "b": ("unsharded, a's per-rank memory", LOGICAL_TOKENS // 2),
    "c": ("unsharded, a's logical capacity", LOGICAL_TOKENS),
}
RERUN = "c2"  # c again: the reference's own run-to-run spread
FLUSH_TRIES = 20
PROBE_IDS = tuple(range(40, 40 + 70))  # one full page and a few tokens: a post-flush probe


@dataclass(frozen=True)
class Target:
    """A prefill under test: its server and the router in front of it."""

    name: str
    server: Server
    router: Router


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="bench_serve_cpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,4,16", help="comma-separated max concurrencies")
    parser.add_argument("--workloads", default="shared-prefix,conversations")
    parser.add_argument("--repeats", type=int, default=1, help="cells repeated (the order of a, b, c rotates every cell)")
    parser.add_argument("--quick", action="store_true", help="concurrency 4 and smaller workloads (a smoke run)")
    parser.add_argument("--groups", type=int, default=6, help="shared-prefix: system prompts")
    parser.add_argument("--prompts-per-group", type=int, default=8)
    parser.add_argument("--system-tokens", type=int, default=512)
    parser.add_argument("--question-tokens", type=int, default=64)
    parser.add_argument("--output-tokens", type=int, default=8)
    parser.add_argument("--conversations", type=int, default=16, help="a turn is sent this many requests after its conversation's previous one")
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--blocks-per-turn", type=int, default=1, help="Mooncake blocks (258 tokens each) a turn adds")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs, L3 folders, bench_serving output")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--png", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.groups, args.prompts_per_group, args.conversations = "4", 6, 3, 4
    return args


def workloads(args: argparse.Namespace, folder: Path) -> List[Workload]:
    made = {
        "shared-prefix": lambda: shared_prefix(args.groups, args.prompts_per_group, args.system_tokens,
                                               args.question_tokens, args.output_tokens),  # fmt: skip
        "conversations": lambda: Conversations(args.conversations, args.turns, args.blocks_per_turn,
                                               args.output_tokens).workload(folder / "conversations.jsonl"),  # fmt: skip
    }
    return [made[name]() for name in args.workloads.split(",") if name]


def flush_and_probe(target: Target) -> Tuple[float, int]:
    """``/flush_cache`` on the prefill (retried while it is busy), then one short request
    through its router: (seconds the probe took, its output tokens; 0 is an empty answer)."""
    for _ in range(FLUSH_TRIES):
        if post(target.server.url, "/flush_cache", b"{}")[0] == 200:
            break
        time.sleep(1.0)
    else:
        raise RuntimeError(f"{target.name}: /flush_cache refused {FLUSH_TRIES} times")
    started = time.monotonic()
    try:
        completion = generate(target.router.url, PROBE_IDS, PROBE_TOKENS, extra={"extra_key": f"probe-{time.time_ns()}"})
    except RequestFailed as error:
        print(f"  {target.name}: the probe after /flush_cache failed: {error}", flush=True)
        return time.monotonic() - started, -1
    return time.monotonic() - started, len(completion.output_ids)


def cached_by_tier(server: Server) -> Dict[str, float]:
    metrics = Metrics.fetch(server.url)
    return {tier: metrics.total("sglang:cached_tokens_total", cache_source=tier) for tier in TIERS}


@dataclass(frozen=True)
class Cells:
    """Runs cells against the three targets: the model, where bench_serving writes."""

    targets: Dict[str, Target]
    model: Path
    folder: Path

    def run(self, workload: Workload, concurrency: int, repeat: int, turn: int) -> List[ConfigRun]:
        """One cell: a, b, c rotated by ``turn`` (each goes first in turn), then c again."""
        order = ["a", "b", "c"][turn % 3 :] + ["a", "b", "c"][: turn % 3]
        return [self.config(label, workload, concurrency, repeat) for label in order + [RERUN]]

    def warm_up(self) -> None:
        """Each prefill's first full-page requests (its first L3 page hash builds a C++
        extension, seconds on this box; its first batches of a shape), not measured."""
        for target in self.targets.values():
            flush_and_probe(target)
            for prompt in warm_up_prompts(pages=8, count=3):
                generate(target.router.url, prompt, 2, extra={"extra_key": "warm-up"})

    def config(self, label: str, workload: Workload, concurrency: int, repeat: int) -> ConfigRun:
        """One configuration's run: flushed and probed, its prefill's hit counters read
        around it, under a key of its own."""
        target = self.targets[label[0]]
        key = f"{workload.name}-c{concurrency}-r{repeat}-{label}"
        probe_s, probe_tokens = flush_and_probe(target)
        before = cached_by_tier(target.server)
        where = BenchTarget(target.router.url, target.router.decode.url)
        bench = run_bench(where, self.model, workload, concurrency, self.folder, key, key)
        after = cached_by_tier(target.server)
        metric_hits = {tier: int(after[tier] - before[tier]) for tier in TIERS}
        run = ConfigRun(label, workload.name, concurrency, bench, metric_hits, probe_s, probe_tokens)
        print(f"  {run.line()}", flush=True)
        return run


def start(run_dir: Path, model: Path) -> Tuple[ServingSession, Dict[str, Target]]:
    half = PrefillSpec(HALF, tp=2, sharded=False, logical_tokens=CONFIGS["b"][1], storage=l3_file_tier(run_dir, HALF))
    session = ServingSession.start(run_dir, model, tp=2, extra=[half])
    server, router = session.extra[HALF]
    targets = {
        "a": Target("a", session.sharded, session.sharded_router),
        "b": Target("b", server, router),
        "c": Target("c", session.reference, session.reference_router),
    }
    return session, targets


def memory_per_rank(targets: Dict[str, Target]) -> Dict[str, Dict[str, float]]:
    """Each prefill's physical device and host pool per rank, from its servers' metrics
    (0.5.23 reports a sharded rank's physical device tokens, ``max_total_num_tokens``, but its
    host pool's logical size, ``hicache_host_total_tokens``: cp x its physical slots)."""
    out = {}
    for label, target in targets.items():
        metrics = Metrics.fetch(target.server.url)
        device = max(metrics.per_rank("sglang:max_total_num_tokens").values(), default=0)
        host = max(metrics.per_rank("sglang:hicache_host_total_tokens").values(), default=0)
        shards = target.server.spec.cp if target.server.spec.sharded else 1
        out[label] = {"device_tokens_per_rank": device, "host_tokens_per_rank": host / shards}
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="bench-serve-cpu-"))
    model = ensure_checkpoint()
    loads = workloads(args, run_dir / "bench")
    report = Report(CONFIGS, loads)
    started = time.monotonic()
    print(f"bench_serve_cpu: run folder {run_dir}", flush=True)
    session, targets = start(run_dir, model)
    try:
        report.memory = memory_per_rank(targets)
        print(f"cluster ready in {time.monotonic() - started:.0f} s; per-rank pools {json.dumps(report.memory)}", flush=True)
        cells = Cells(targets, model, run_dir / "bench")
        cells.warm_up()
        turn = 0
        for workload in loads:
            for concurrency in [int(c) for c in args.concurrency.split(",")]:
                for repeat in range(args.repeats):
                    print(f"{workload.name}, concurrency {concurrency}, repeat {repeat}:", flush=True)
                    report.add(cells.run(workload, concurrency, repeat, turn))
                    turn += 1
    except Exception as error:  # e.g. a server killed mid-cell: report the cells that finished
        logging.getLogger("bench_serve_cpu").exception("stopped")
        report.stopped = repr(error)
    finally:
        session.close()
    print(report.text())
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report.as_dict(), indent=1))
    if args.png is not None:
        write_png(report, args.png)
    print(f"{'PASS' if report.correct() else 'FAIL'} in {time.monotonic() - started:.0f} s; logs in {run_dir}")
    return 0 if report.correct() else 1


if __name__ == "__main__":
    sys.exit(main())
