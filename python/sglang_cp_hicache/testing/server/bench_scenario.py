"""The serving benchmark's short form (the 0.5.23 scenario ``bench_serving_concurrency`` in
``scenarios.py``): SGLang's own ``bench_serving`` at concurrency 4 through the sharded
router, the reference router, and the reference router again, greedy outputs compared request
by request (``bench_run.py``).

Under concurrency the batches a request shares change the last bits of CPU GEMMs, so the
reference does not agree with itself on every request: the sharded server must agree with
the reference as often as the reference agrees with its own rerun (within
``bench_run.tolerance``), no request may fail, and the decode must finish every request with
all its tokens (an empty success is a failure). Every run sends its prompts under a key of
its own (``extra_key``), so each starts cold on its server without a ``/flush_cache``. Costs
about 2 minutes on 2 cores (three ``bench_serving`` processes, about 20 s of start-up each).
"""

from __future__ import annotations

import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List

from sglang_cp_hicache.testing.server.bench_run import (
    BenchRun,
    BenchTarget,
    agreement,
    agrees_like_reference,
    run_bench,
    tolerance,
)
from sglang_cp_hicache.testing.server.bench_workloads import shared_prefix
from sglang_cp_hicache.testing.server.cluster import Router
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED

CONCURRENCY = 4
#: 32 requests of 5 pages (4 system prompts of 4 pages, 1-page questions), 4 new tokens each
WORKLOAD = shared_prefix(groups=4, prompts_per_group=8, system_tokens=256, question_tokens=64, output_tokens=4)
RERUN = "reference-rerun"


@dataclass
class ConcurrencyCheck:
    """What the three runs showed: the runs by label, what broke, what to note."""

    runs: Dict[str, BenchRun] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    @property
    def requests(self) -> int:
        return sum(len(run.requests) for run in self.runs.values())


def greedy_under_concurrency(sharded: Router, reference: Router, model: Path, folder: Path) -> ConcurrencyCheck:
    """The three ``bench_serving`` runs and the criterion (a run that fails to start or
    finish ends the check with that problem)."""
    check = ConcurrencyCheck()
    stamp = time.time_ns()
    for label, router in ((SHARDED, sharded), (REFERENCE, reference), (RERUN, reference)):
        target = BenchTarget(router.url, router.decode.url)
        try:
            run = run_bench(target, model, WORKLOAD, CONCURRENCY, folder, f"{label}-{stamp}", f"{label}-{stamp}")
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            check.problems.append(f"bench_serving via {router.name}: {error}")
            return check
        check.runs[label] = run
        if len(run.requests) != WORKLOAD.requests:
            check.problems.append(f"{label}: {len(run.requests)} of {WORKLOAD.requests} requests ran")
        if run.incomplete():
            check.problems.append(f"not every answer has its tokens: {run.incomplete()}")
        check.notes.append(
            f"{label}: {run.summary.get('request_throughput', 0):.2f} req/s, TTFT p50 {run.summary.get('median_ttft_ms', 0):.0f} ms, "
            f"{run.failed} failed, decode tokens {run.decoded.tokens}/{run.expected_tokens}, {run.blank} blank texts, "
            f"bench_serving {run.wall_s:.0f} s"
        )  # fmt: skip
    ours, spread = agreement(check.runs[SHARDED], check.runs[REFERENCE]), agreement(check.runs[REFERENCE], check.runs[RERUN])
    problem = agrees_like_reference(ours, spread)
    if problem:
        check.problems.append(f"greedy outputs under concurrency: {problem}")
    check.notes.append(f"greedy outputs differ: sharded vs reference {ours.mismatched}/{ours.requests}, reference vs its rerun "
                       f"{spread.mismatched}/{spread.requests} (tolerance {tolerance(ours, spread):.3f})")  # fmt: skip
    return check


__all__ = ["CONCURRENCY", "ConcurrencyCheck", "WORKLOAD", "greedy_under_concurrency"]
