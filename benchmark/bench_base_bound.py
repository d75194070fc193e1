"""How balanced can the sharded traffic of a workload be under upstream 0.5.23's rotation
contract, whatever rotation bases a placement rule picks?

Under ``--enable-kv-cache-sharding`` the page at position ``p`` of a chain with rotation
base ``b`` lives on rank ``owner_of(b, p, cp)`` (``core.rotation``), and a cached path is one rotation run
(``unified_tree_core._rotation_conflict``): every request that continues a system prompt
continues that prompt's rotation. While the system prompts stay cached, their bases are the
only choice a placement rule has. This model takes the simulator's own trace
(``sim.workload.generate_workload``), tries every assignment of bases to the system prompts
(the first fixed at 0: rotating all of them relabels the lanes) and prints, per cell, the
best and worst max-rank / (logical / cp) it can reach for:

* **PD sent**: every token of every request's prompt, sent by its owner (the transfer moves
  the whole prompt's KV);
* **D2H**: each page-aligned page a request adds to its session's cached prompt (the system
  prompt's pages once), backed up by its owner.

Evictions are not modelled (a re-prefilled prompt backs up again), so this is the floor of
the rule, not a replay; the simulator's own figures are in docs/simulator.md and
docs/pd_transfer.md. No SGLang import; either venv runs it:

    PYTHONPATH=python .venv-sglang-0.5.23/bin/python benchmark/bench_base_bound.py
    PYTHONPATH=python .venv/bin/python benchmark/bench_base_bound.py --workloads default long --cp-sizes 4 8 --seeds 0 1 2
"""

from __future__ import annotations

import argparse
import itertools
from dataclasses import dataclass
from typing import Dict, List, Sequence, Tuple

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.workload import generate_workload

TARGET = 1.10


@dataclass(frozen=True)
class PromptDemand:
    """Per system prompt, tokens sent and pages backed up at each position-page."""

    sent_tokens: List[List[int]]  # [prompt][position page] -> tokens
    backup_pages: List[List[int]]  # [prompt][position page] -> pages


def prompt_demand(cfg: SimConfig) -> PromptDemand:
    """The trace's traffic per system prompt and position-page, independent of bases."""
    page = cfg.page_size
    requests = generate_workload(cfg)
    prompt_pages = cfg.max_prompt_len // page + 1
    sent = [[0] * prompt_pages for _ in range(cfg.num_system_prompts)]
    backup = [[0] * prompt_pages for _ in range(cfg.num_system_prompts)]
    system_of: Dict[str, int] = {}  # session -> its system prompt's index
    cached_pages: Dict[str, int] = {}  # session -> page-aligned pages of its cached prompt
    system_pages = cfg.system_prompt_len // page
    heads: Dict[Tuple[int, ...], int] = {}  # a system prompt's tokens -> its index
    for request in requests:
        tokens = request.token_ids
        if request.session_id not in system_of:
            head = tuple(tokens[: cfg.system_prompt_len])
            seen = head in heads  # its pages are cached (and backed up) once, by its first session
            system_of[request.session_id] = heads.setdefault(head, len(heads))
            cached_pages[request.session_id] = system_pages if seen else 0
        s = system_of[request.session_id]
        n = len(tokens)
        for p in range(-(-n // page)):
            sent[s][p] += min(page, n - p * page)
        full = n // page
        for p in range(cached_pages[request.session_id], full):
            backup[s][p] += 1
        cached_pages[request.session_id] = max(cached_pages[request.session_id], full)
    if len(heads) > cfg.num_system_prompts:
        raise ValueError(f"{len(heads)} distinct system prompts in a trace built with {cfg.num_system_prompts}")
    return PromptDemand(sent, backup)


def lane_loads(per_position: List[List[int]], bases: Sequence[int], cp: int) -> List[int]:
    loads = [0] * cp
    for prompt, base in enumerate(bases):
        for position, amount in enumerate(per_position[prompt]):
            loads[owner_of(base, position, cp)] += amount
    return loads


def ratio(loads: Sequence[int]) -> float:
    total = sum(loads)
    return max(loads) / (total / len(loads)) if total else 1.0


@dataclass(frozen=True)
class Bound:
    best_sent: Tuple[float, Tuple[int, ...]]
    best_d2h: Tuple[float, Tuple[int, ...]]
    best_both: Tuple[float, Tuple[int, ...]]  # the bases minimising max(sent, D2H)
    worst_sent: float


def base_bound(demand: PromptDemand, cp: int) -> Bound:
    prompts = len(demand.sent_tokens)
    rows = []
    for rest in itertools.product(range(cp), repeat=prompts - 1):
        bases = (0, *rest)
        sent = ratio(lane_loads(demand.sent_tokens, bases, cp))
        d2h = ratio(lane_loads(demand.backup_pages, bases, cp))
        rows.append((sent, d2h, bases))
    return Bound(
        best_sent=min((s, b) for s, _, b in rows),
        best_d2h=min((d, b) for _, d, b in rows),
        best_both=min((max(s, d), b) for s, d, b in rows),
        worst_sent=max(s for s, _, _ in rows),
    )


def main(argv: Sequence[str] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", nargs="+", default=["default", "long"])
    parser.add_argument("--cp-sizes", nargs="+", type=int, default=[2, 4, 8])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    args = parser.parse_args(argv)
    print(f"best / worst max-rank / (logical/cp) over every base assignment (target {TARGET:.2f})")
    print(f"{'workload':>9} {'cp':>3} {'seed':>4} {'PD sent best':>13} {'D2H best':>9} "
          f"{'max(both) best':>15} {'bases':>12} {'PD sent worst':>14}")  # fmt: skip
    for workload, cp, seed in itertools.product(args.workloads, args.cp_sizes, args.seeds):
        bound = base_bound(prompt_demand(SimConfig.preset(workload, cp_size=cp, seed=seed)), cp)
        both, bases = bound.best_both
        print(
            f"{workload:>9} {cp:>3} {seed:>4} {bound.best_sent[0]:>13.3f} {bound.best_d2h[0]:>9.3f} "
            f"{both:>15.3f} {str(bases):>12} {bound.worst_sent:>14.3f}"
            + ("" if both <= TARGET else "  (no base rule meets the target)")
        )  # fmt: skip


if __name__ == "__main__":
    main()
