"""``python -m sglang_cp_hicache.testing.server`` (``scripts/serve_cpu.sh``): SGLang's own PD
cluster on this CPU box, the sharded prefill against its unsharded reference, every scenario
(or the ones named), a table per scenario, exit 1 on any difference or unmet expectation;
or, with ``--keep``, the cluster kept up for one's own requests (:mod:`.keep`).

Every process it starts runs in its own process group and is ended when it stops (also on
Ctrl-C); logs stay in the run folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import tempfile
import time
from pathlib import Path
from typing import List, Optional, Sequence

from sglang_cp_hicache.testing.server.client import TIERS
from sglang_cp_hicache.testing.server.keep import keep
from sglang_cp_hicache.testing.server.launch import line_launch
from sglang_cp_hicache.testing.server.scenarios import BY_HAND, BY_NAME, Scenario, ScenarioReport, scenarios_for
from sglang_cp_hicache.testing.server.trace_replay import trace_replay
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession
from sglang_cp_hicache.testing.server.soak import SoakConfig, run_soak
from sglang_cp_hicache.testing.server.tiny_model import TinyDsaSpec, ensure_checkpoint

logger = logging.getLogger(__name__)


def parse_args(argv: Optional[Sequence[str]]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="serve_cpu", description=__doc__.split("\n\n")[0])
    names = [s.name for s in scenarios_for(line_launch())]
    by_hand = [s.name for s in BY_HAND if s.applies_to(line_launch())]
    parser.add_argument("--scenarios", default=",".join(names),
                        help=f"comma-separated, from: {', '.join(names)}; only when named: {', '.join(by_hand) or '-'}")  # fmt: skip
    parser.add_argument("--trace", type=Path, help="replay a simulator JSONL trace (prompts scaled to the context)")
    parser.add_argument("--trace-limit", type=int, default=None, help="first N requests of the trace")
    parser.add_argument("--trace-seed", type=int, default=0)
    parser.add_argument("--tp", type=int, default=2, help="prefill TP size (= its CP size)")
    parser.add_argument("--cp", type=int, default=None, help="prefill CP size (must equal --tp)")
    parser.add_argument("--run-dir", type=Path, default=None, help="logs and L3 folders (default: a new temp folder)")
    parser.add_argument("--json", type=Path, default=None, help="write every report as JSON here")
    parser.add_argument("--model-seed", type=int, default=0, help="the tiny checkpoint's seed")
    parser.add_argument("--keep", action="store_true", help="run no scenario: serve until Ctrl-C or SIGTERM, then end every process")
    parser.add_argument("--urls-file", type=Path, default=None, help="with --keep: write the routers' and servers' URLs here as JSON")
    parser.add_argument("--soak", type=float, default=None, metavar="MINUTES", help="run no scenario: a soak with faults (testing/server/soak.py)")
    parser.add_argument("--soak-seed", type=int, default=None, help="the soak's seed (default: drawn and printed)")
    parser.add_argument("--soak-concurrency", type=int, default=8)
    args = parser.parse_args(argv)
    if args.urls_file is not None and not args.keep:
        parser.error("--urls-file needs --keep")
    if args.keep and args.soak is not None:
        parser.error("--keep and --soak: one at a time")
    if args.cp is not None and args.cp != args.tp:
        parser.error(f"--cp {args.cp} != --tp {args.tp}: a DSA interleave prefill's CP size is its TP size")
    unknown = [n for n in args.scenarios.split(",") if n and n not in BY_NAME]
    if unknown:
        parser.error(f"unknown scenarios {unknown}; known: {', '.join(names)}")
    return args


def _tiers(cached: dict) -> str:
    return "/".join(str(cached.get(tier, 0)) for tier in TIERS)


def report_table(reports: Sequence[ScenarioReport]) -> str:
    header = (
        f"{'scenario':<40} {'req':>4} {'ids same':>8} {'max|dlp|':>9} "
        f"{'cached sharded d/h/s':>21} {'cached ref d/h/s':>18} {'TTFT cached/cold':>22} "
        f"{'PD sent MB/rank':>18} {'wall s':>7}  result"
    )
    lines = [header, "-" * len(header)]
    for r in reports:
        ttft = ", ".join(f"{tier} {ratio:.2f}" for tier, ratio in sorted(r.ttft_ratio.items())) or "-"
        sent = " ".join(f"{v:.2f}" for _, v in sorted(r.sent_mb_per_rank.items())) or "-"
        lines.append(
            f"{r.name[:40]:<40} {r.requests:>4} {'yes' if r.identical else 'NO':>8} {r.max_logprob_diff:>9.3g} "
            f"{_tiers(r.cached.get(SHARDED, {})):>21} {_tiers(r.cached.get(REFERENCE, {})):>18} {ttft:>22} "
            f"{sent:>18} {r.wall_s:>7.1f}  {'ok' if r.ok else 'FAIL'}"
        )
        for text in r.mismatches + r.problems:
            lines.append(f"    ! {text}")
        for text in r.notes:
            lines.append(f"    - {text}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    scenarios: List[Scenario] = [BY_NAME[n] for n in args.scenarios.split(",") if n]
    if args.trace is not None:
        scenarios.append(trace_replay(args.trace, args.trace_seed, args.trace_limit))
    run_dir = args.run_dir or Path(tempfile.mkdtemp(prefix="serve-cpu-"))
    model = ensure_checkpoint(TinyDsaSpec(seed=args.model_seed))
    started = time.monotonic()
    print(f"serve_cpu: sglang {line_launch().release}, prefill tp {args.tp}, run folder {run_dir}", flush=True)
    if args.keep:
        return keep(run_dir, model, args.tp, args.urls_file)
    if args.soak is not None:
        seed = args.soak_seed if args.soak_seed is not None else random.randrange(1 << 31)
        return run_soak(run_dir, model, args.tp, SoakConfig(args.soak, seed, args.soak_concurrency), args.json)
    session = ServingSession.start(run_dir, model, tp=args.tp)
    reports: List[ScenarioReport] = []
    try:
        starts = ", ".join(f"{name} {s:.0f} s" for name, s in session.start_times.items())
        print(f"cluster ready in {time.monotonic() - started:.0f} s ({starts})", flush=True)
        for scenario in scenarios:
            report = scenario.run(session)
            reports.append(report)
            print(f"{report.name}: {'ok' if report.ok else 'FAIL'} in {report.wall_s:.1f} s", flush=True)
    finally:
        session.close()
    leftover = session.running()
    print(report_table(reports))
    if args.json is not None:
        args.json.write_text(json.dumps([r.as_dict() for r in reports], indent=1, default=str))
    failed = [r.name for r in reports if not r.ok]
    total = time.monotonic() - started
    if leftover:
        print(f"FAIL processes still running: {leftover}")
        return 1
    print(f"{'FAIL' if failed else 'PASS'} {len(reports) - len(failed)}/{len(reports)} scenarios in {total:.0f} s"
          + (f"; failed: {', '.join(failed)}" if failed else "") + f"; logs in {run_dir / 'logs'}")
    return 1 if failed else 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s: %(message)s")
    return run(parse_args(argv))


__all__ = ["main", "parse_args", "report_table", "run"]
