"""Multi-rank CPU simulator of CP shared KV with HiCache (see docs/simulator.md).

Stable API::

    from sglang_cp_hicache.sim import SimConfig, run_simulation
    report = run_simulation(SimConfig(cp_size=4, seed=0, num_requests=100))
    assert report.passed

The installed SGLang release picks the line's driver (``sim/v0_5_12``, ``sim/v0_5_23``); the
engine (config, workload, report, CLI, plot) is shared. ``SimConfig.shard_impl`` picks the
main column; the report carries every column that ran (``SimReport.columns``).
"""

from sglang_cp_hicache.sim.config import FAULTS, SHARD_IMPLS, WORKLOADS, SimConfig
from sglang_cp_hicache.sim.report import (
    BaselineSummary,
    ColumnSummary,
    LaneBalance,
    SimReport,
    format_table,
)
from sglang_cp_hicache.sim.simulation import run_simulation
from sglang_cp_hicache.sim.workload import Request, TraceError, generate_workload, load_trace

__all__ = [
    "FAULTS",
    "BaselineSummary",
    "ColumnSummary",
    "LaneBalance",
    "Request",
    "SHARD_IMPLS",
    "SimConfig",
    "SimReport",
    "TraceError",
    "WORKLOADS",
    "format_table",
    "generate_workload",
    "load_trace",
    "run_simulation",
]
