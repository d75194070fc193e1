"""The serving benchmark's short form as a scenario (0.5.23 line): SGLang's own
``bench_serving`` at concurrency 4 through the sharded router, the reference router, and the
reference router again, greedy outputs compared request by request (``bench_run.py``).

Under concurrency the batches a request shares change the last bits of CPU GEMMs, so the
reference does not agree with itself on every request: the sharded server must agree with
the reference as often as the reference agrees with its own rerun (within
``bench_run.tolerance``), no request may fail, and the decode must finish every request with
all its tokens (an empty success is a failure). Every run sends its
prompts under a key of its own (``extra_key``), so each starts cold on its server without a
``/flush_cache``. Costs about 2 minutes on 2 cores (three ``bench_serving`` processes, about
20 s of start-up each).
"""

from __future__ import annotations

import subprocess
import time
from typing import Dict

from sglang_cp_hicache.testing.server.bench_run import (
    BenchRun,
    BenchTarget,
    agreement,
    agrees_like_reference,
    run_bench,
    tolerance,
)
from sglang_cp_hicache.testing.server.bench_workloads import shared_prefix
from sglang_cp_hicache.testing.server.scenarios import Recorder, ScenarioReport
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession

CONCURRENCY = 4
#: 32 requests of 5 pages (4 system prompts of 4 pages, 1-page questions), 4 new tokens each
WORKLOAD = shared_prefix(groups=4, prompts_per_group=8, system_tokens=256, question_tokens=64, output_tokens=4)
RERUN = "reference-rerun"


def bench_serving_concurrency(session: ServingSession) -> ScenarioReport:
    rec = Recorder(session, f"bench_serving at concurrency {CONCURRENCY}: greedy outputs")
    folder = session.cluster.run_dir / "bench"
    stamp = time.time_ns()
    routers = ((SHARDED, session.sharded_router), (REFERENCE, session.reference_router), (RERUN, session.reference_router))
    runs: Dict[str, BenchRun] = {}
    for label, router in routers:
        target = BenchTarget(router.url, router.decode.url)
        try:
            runs[label] = run_bench(target, session.cluster.model, WORKLOAD, CONCURRENCY, folder, f"{label}-{stamp}", f"{label}-{stamp}")
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            rec.expect(False, f"bench_serving via {router.name}: {error}")
            return rec.finish()
        run = runs[label]
        rec.report.requests += len(run.requests)
        rec.expect(len(run.requests) == WORKLOAD.requests, f"{label}: {len(run.requests)} of {WORKLOAD.requests} requests ran")
        problem = run.incomplete()
        rec.expect(problem is None, f"not every answer has its tokens: {problem}")
        rec.note(f"{label}: {run.summary.get('request_throughput', 0):.2f} req/s, TTFT p50 {run.summary.get('median_ttft_ms', 0):.0f} ms, "
                 f"{run.failed} failed, decode tokens {run.decoded.tokens}/{run.expected_tokens}, {run.blank} blank texts, "
                 f"bench_serving {run.wall_s:.0f} s")  # fmt: skip
    for side in (SHARDED, REFERENCE):
        rec.report.cached[side] = runs[side].hits()
    sharded, spread = agreement(runs[SHARDED], runs[REFERENCE]), agreement(runs[REFERENCE], runs[RERUN])
    problem = agrees_like_reference(sharded, spread)
    rec.expect(problem is None, f"greedy outputs under concurrency: {problem}")
    rec.note(f"greedy outputs differ: sharded vs reference {sharded.mismatched}/{sharded.requests}, reference vs its rerun "
             f"{spread.mismatched}/{spread.requests} (tolerance {tolerance(sharded, spread):.3f})")  # fmt: skip
    return rec.finish()


__all__ = ["CONCURRENCY", "WORKLOAD", "bench_serving_concurrency"]
