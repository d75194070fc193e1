"""The fleet comparison: one shared L3 store against node-local stores, and its table.

Node-local means each instance has its own L3 (a store on its own node, e.g. the file
backend on local disk or a Mooncake master per node), not none: both sides then hold the
same tiers per instance and differ only in whether one instance's pages reach another, so
the ratio measures sharing, not having L3 (without L3 the local side's L3 column is 0 and
its other tiers are unchanged).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import List, Sequence

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.fleet.run import FleetRun, run_fleet
from sglang_cp_hicache.sim.workload import Request

_MIB = float(1 << 20)


@dataclass(frozen=True)
class FleetComparison:
    cfg: SimConfig
    requests: int
    single: FleetRun  # one instance alone: the fleet's reference
    shared: FleetRun
    local: FleetRun

    def write_json(self, path: str) -> None:
        """Every run's figures, per instance and per owner rank (``dataclasses.asdict``)."""
        runs = {name: dataclasses.asdict(getattr(self, name)) for name in ("shared", "local", "single")}
        with open(path, "w", encoding="utf-8") as handle:
            json.dump({"config": dataclasses.asdict(self.cfg), "requests": self.requests, **runs}, handle, indent=2)
            handle.write("\n")


def fleet_refusals(cfg: SimConfig) -> List[str]:
    """What the fleet replay does not model; each would be ignored, so it is refused."""
    problems = []
    if cfg.pd or cfg.fault is not None or cfg.shard_impl != "plugin":
        problems.append("--pd, --fault and --shard-impl native run one instance")
    if cfg.storage_backend is not None or cfg.storage_logical_baseline:
        problems.append("the fleet's L3 is its own store model: no --storage-* options")
    if cfg.chunked_prefill_size or cfg.abort_prob or cfg.retract_prob or cfg.inflight_steps:
        problems.append("chunks, aborts, retractions and writes in flight are single-instance features")
    return problems


def compare_fleet(requests: Sequence[Request], cfg: SimConfig, instances: int, router: str) -> FleetComparison:
    """The same trace on ``instances`` instances with one shared store, with local stores,
    and on one instance."""
    return FleetComparison(
        cfg,
        len(requests),
        run_fleet(requests, cfg, 1, router, shared=True),
        run_fleet(requests, cfg, instances, router, shared=True),
        run_fleet(requests, cfg, instances, router, shared=False),
    )


def _mib(values: Sequence[int]) -> str:
    return ", ".join(f"{v / _MIB:.2f}" for v in values)


def _row(label: str, run: FleetRun) -> str:
    rates = run.hit_rates()
    dedup = sum(m.dedup_pages for m in run.meters)
    return (
        f"| {label} | {rates['all']:.3f} | {rates['device']:.3f} | {rates['host']:.3f} | "
        f"{rates['storage']:.3f} | {_mib(run.written_bytes())} | {_mib(run.read_bytes())} | "
        f"{dedup} | {run.stored_pages} |"
    )


def _owner_lines(label: str, run: FleetRun) -> List[str]:
    """Pages per owner rank (``core.rotation.owner_of``) of each instance."""
    return [
        f"  {label}, instance {i}: written {m.written_pages}, read {m.read_pages} pages per rank"
        for i, m in enumerate(run.meters)
    ]


def _ratio(shared: float, local: float) -> str:
    return f"{shared / local:.3f}" if local else "n/a"


def format_fleet(comparison: FleetComparison) -> str:
    """The printed table: a row per store arrangement and the ratio shared / local."""
    c, shared, local = comparison.cfg, comparison.shared, comparison.local
    head = (
        f"fleet: {shared.instances} prefill instances x cp {c.cp_size}, router {shared.router}, "
        f"{comparison.requests} requests (workload {c.workload}, seed {c.seed}), "
        f"batch {c.batch_size} per instance per round; page {c.page_size}, "
        f"{shared.page_bytes} bytes per stored page"
    )
    cols = (
        "| L3 | hit rate | device | host | L3 | L3 written per instance (MiB) | "
        "L3 read per instance (MiB) | pages not rewritten | pages stored |"
    )
    rs, rl = shared.hit_rates(), local.hit_rates()
    ratio = (
        f"| shared / local | {_ratio(rs['all'], rl['all'])} | | | {_ratio(rs['storage'], rl['storage'])} | "
        f"{_ratio(sum(shared.written_bytes()), sum(local.written_bytes()))} (fleet) | "
        f"{_ratio(sum(shared.read_bytes()), sum(local.read_bytes()))} (fleet) | | "
        f"{_ratio(shared.stored_pages, local.stored_pages)} |"
    )
    return "\n".join(
        [
            head, "", cols, "|" + "---|" * 9,
            _row("one shared store", shared),
            _row("a store per instance", local),
            ratio,
            _row("(1 instance alone)", comparison.single),
            "",
            "L3 pages per owner rank:",
            *_owner_lines("shared", shared),
            *_owner_lines("local", local),
        ]
    )  # fmt: skip


__all__ = ["FleetComparison", "compare_fleet", "fleet_refusals", "format_fleet"]
