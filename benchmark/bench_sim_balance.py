"""Owner-lane balance of CP shared KV, measured by the simulator (issue 12's targets).

Per-rank skew of peak host bytes and of D2H/H2D traffic over a sweep of cp sizes and
workloads.

Each run replays the workload on ``cp`` gloo ranks (no cp-1 baseline) and must pass the
simulator's own checks. Targets, per run: max-rank / mean host peak bytes and D2H bytes
<= 1.10, H2D <= 1.15; at cp 8 on the long workload also max-rank / (logical / cp) <= 1.10
for host peak bytes, D2H and H2D. One run at a time (ranks share the machine's cores).

    PYTHONPATH=python .venv/bin/python benchmark/bench_sim_balance.py
    PYTHONPATH=python .venv/bin/python benchmark/bench_sim_balance.py --cp-sizes 4 --workloads long
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from sglang_cp_hicache.sim import SimConfig, SimReport, run_simulation
from sglang_cp_hicache.sim.config import WORKLOADS

# (LaneBalance field, limit, column title)
SKEW_TARGETS: Tuple[Tuple[str, float, str], ...] = (
    ("host_peak_bytes_skew", 1.10, "host/mean"),
    ("d2h_bytes_skew", 1.10, "D2H/mean"),
    ("h2d_bytes_skew", 1.15, "H2D/mean"),
)
LOGICAL_TARGETS: Tuple[Tuple[str, float, str], ...] = (
    ("host_peak_bytes_vs_logical", 1.10, "host/(L/cp)"),
    ("d2h_bytes_vs_logical", 1.10, "D2H/(L/cp)"),
    ("h2d_bytes_vs_logical", 1.10, "H2D/(L/cp)"),
)
LANE_COLUMNS: Tuple[Tuple[str, str], ...] = (
    ("device_lane_peak_skew", "dev lane pk"),
    ("host_lane_peak_skew", "host lane pk"),
)


@dataclass
class Row:
    workload: str
    cp_size: int
    report: SimReport

    def targets(self) -> Tuple[Tuple[str, float, str], ...]:
        """The targets that apply: logical/cp ones only at cp 8 on the long workload."""
        if self.cp_size == 8 and self.workload == "long":
            return SKEW_TARGETS + LOGICAL_TARGETS
        return SKEW_TARGETS

    def misses(self) -> List[str]:
        balance = self.report.balance
        missed = [
            f"{title} {getattr(balance, name):.3f} > {limit:.2f}"
            for name, limit, title in self.targets()
            if getattr(balance, name) > limit
        ]
        if not self.report.passed:
            missed.append("simulator checks FAILED")
        return missed


def run_one(workload: str, cp_size: int, seed: int, num_requests: Optional[int]) -> Row:
    overrides: Dict[str, object] = dict(
        cp_size=cp_size, seed=seed, baseline=False, timeout_s=900.0
    )
    if num_requests is not None:
        overrides["num_requests"] = num_requests
    report = run_simulation(SimConfig.preset(workload, **overrides))
    return Row(workload, cp_size, report)


def _header() -> str:
    titles = ["workload", "cp", "reqs", "wall s", "D2H pages", "H2D pages"]
    titles += [t for _, _, t in SKEW_TARGETS + LOGICAL_TARGETS] + [t for _, t in LANE_COLUMNS]
    return "".join(f"{t:>13}" for t in titles) + "  result"


def format_row(row: Row) -> str:
    r, b = row.report, row.report.balance
    page_bytes = r.config["page_size"] * r.bytes_per_token
    cells = [row.workload, row.cp_size, r.requests, f"{r.wall_s:.0f}"]
    # Logical pages moved: max/mean over few pages is coarse (one page of 8 is 1.125x).
    cells += [r.replicated_d2h_bytes // page_bytes, r.replicated_h2d_bytes // page_bytes]
    cells += [f"{getattr(b, name):.3f}" for name, _, _ in SKEW_TARGETS + LOGICAL_TARGETS]
    cells += [f"{getattr(b, name):.3f}" for name, _ in LANE_COLUMNS]
    misses = row.misses()
    verdict = "PASS" if not misses else "FAIL: " + "; ".join(misses)
    return "".join(f"{str(c):>13}" for c in cells) + "  " + verdict


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-sizes", type=int, nargs="+", default=[3, 4, 5, 8])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS),
                        default=["default", "long"])  # fmt: skip
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--num-requests", type=int, help="override the presets' request count")
    args = parser.parse_args()
    print(_header(), flush=True)
    rows = []
    for workload in args.workloads:
        for cp_size in args.cp_sizes:
            rows.append(run_one(workload, cp_size, args.seed, args.num_requests))
            print(format_row(rows[-1]), flush=True)
    failed = [row for row in rows if row.misses()]
    print(f"\n{len(rows) - len(failed)}/{len(rows)} runs meet every target")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
