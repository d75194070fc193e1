"""``run_simulation``: the trace on ``cp_size`` gloo ranks through the installed SGLang line,
then the comparison columns (upstream's native sharding where the line has it, the cp-1
upstream replay)."""

from __future__ import annotations

import logging
import time

from sglang_cp_hicache.core.releases import line_package
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.lines import installed_line
from sglang_cp_hicache.sim.pd import line_pd, run_pd_column
from sglang_cp_hicache.sim.report.build import build_report
from sglang_cp_hicache.sim.report.records import SimReport
from sglang_cp_hicache.sim.workload import load_workload, plan_steps

logger = logging.getLogger(__name__)


def run_simulation(cfg: SimConfig) -> SimReport:
    """Replay the workload on ``cfg.cp_size`` simulated scheduler ranks and check it.

    Raises ValueError for what the installed line cannot run (e.g. ``shard_impl='native'``
    on 0.5.12.post1), ``testing.dist.RankFailed`` if a rank crashes (e.g. a cache
    assertion) or, with ``cfg.pd``, a PD role fails; every property the simulator proves is
    reported in the returned :class:`SimReport`, for every column (with ``cfg.pd``, the
    decode side's checks of every transfer too).
    """
    # SGLang never loads in this process: each rank installs the CPU runtime and forks
    # from a server that has SGLang imported.
    from sglang_cp_hicache.testing.dist import run_ranks

    line = installed_line()
    line.check(cfg)
    pd_roles = line_pd(line_package().rsplit(".", 1)[1]) if cfg.pd else None  # refuses first
    start = time.perf_counter()
    requests = load_workload(cfg)
    steps = plan_steps(requests, cfg)
    pd_stats = None
    results = {}
    with line.storage(cfg) as storage:  # L3 folders or a local store, for this run only
        columns = line.columns(cfg, storage)
        logger.info(
            "%d requests in %d prefill batches; columns %s on SGLang %s",
            len(requests), len(steps), [c.label for c in columns], line.release,
        )  # fmt: skip
        for column in columns:
            if cfg.pd and column is columns[0]:
                # The main column's ranks as PD prefill servers, each finished prefill sent
                # to and checked on a decode process (sim/pd.py).
                results[column.name], pd_stats = run_pd_column(pd_roles, cfg, steps, *column.args)
            else:
                results[column.name] = run_ranks(
                    column.world_size, column.entry, cfg, steps, *column.args,
                    timeout_s=cfg.timeout_s,
                )  # fmt: skip
    wall_s = time.perf_counter() - start
    return build_report(cfg, line, columns, results, len(requests), len(steps), wall_s, pd_stats)
