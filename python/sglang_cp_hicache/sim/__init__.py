"""Multi-rank CPU simulator of CP shared KV with HiCache (see docs/simulator.md).

Stable API::

    from sglang_cp_hicache.sim import SimConfig, run_simulation
    report = run_simulation(SimConfig(cp_size=4, seed=0, num_requests=100))
    assert report.passed

The installed SGLang release picks the line's driver (``sim/v0_5_12``, ``sim/v0_5_23``); the
engine (config, workload, report, CLI, plot) is shared. ``SimConfig.shard_impl`` picks the
main column; the report carries every column that ran (``SimReport.columns``). Inside the
project, import from the module that defines a name.
"""

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.simulation import run_simulation

__all__ = ["SimConfig", "run_simulation"]
