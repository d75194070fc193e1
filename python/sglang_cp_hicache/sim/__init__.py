"""Multi-rank CPU simulator of CP shared KV with HiCache (see docs/simulator.md).

Stable API::

    from sglang_cp_hicache.sim import SimConfig, run_simulation
    report = run_simulation(SimConfig(cp_size=4, seed=0, num_requests=100))
    assert report.passed
"""

from sglang_cp_hicache.sim.config import FAULTS, WORKLOADS, SimConfig
from sglang_cp_hicache.sim.report import BaselineSummary, LaneBalance, SimReport, format_table
from sglang_cp_hicache.sim.simulation import run_simulation
from sglang_cp_hicache.sim.workload import Request, TraceError, generate_workload, load_trace

__all__ = [
    "FAULTS",
    "BaselineSummary",
    "LaneBalance",
    "Request",
    "SimConfig",
    "SimReport",
    "TraceError",
    "WORKLOADS",
    "format_table",
    "generate_workload",
    "load_trace",
    "run_simulation",
]
