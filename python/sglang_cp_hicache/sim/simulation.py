"""``run_simulation``: the trace on ``cp_size`` gloo ranks, then the cp-1 upstream replay."""

from __future__ import annotations

import logging
import time

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.rank import baseline_rank_main, cp_rank_main
from sglang_cp_hicache.sim.report import SimReport, build_report
from sglang_cp_hicache.sim.workload import load_workload, plan_steps

logger = logging.getLogger(__name__)


def run_simulation(cfg: SimConfig) -> SimReport:
    """Replay the workload on ``cfg.cp_size`` simulated scheduler ranks and check it.

    Raises ``testing.dist.RankFailed`` if a rank crashes (e.g. a cache assertion); every
    property the simulator proves is reported in the returned :class:`SimReport`.
    """
    # SGLang never loads in this process: each rank installs the CPU runtime and forks
    # from a server that has SGLang imported.
    from sglang_cp_hicache.testing.dist import run_ranks

    start = time.perf_counter()
    requests = load_workload(cfg)
    steps = plan_steps(requests, cfg)
    logger.info(
        "%d requests in %d prefill batches on %d CP ranks", len(requests), len(steps), cfg.cp_size
    )
    results = run_ranks(cfg.cp_size, cp_rank_main, cfg, steps, timeout_s=cfg.timeout_s)
    baseline = None
    if cfg.baseline:
        baseline = run_ranks(1, baseline_rank_main, cfg, steps, timeout_s=cfg.timeout_s)[0]
    wall_s = time.perf_counter() - start
    return build_report(cfg, results, baseline, len(requests), len(steps), wall_s)
