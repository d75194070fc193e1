"""Command line: ``python -m sglang_cp_hicache.sim`` / ``sglang-cp-hicache-sim``.

Exit codes: 0 all checks passed, 1 a check failed (or a rank crashed), 2 bad usage.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional, Tuple

from sglang_cp_hicache.sim.config import FAULTS, SHARD_IMPLS, STORAGE_BACKENDS, WORKLOADS, SimConfig

logger = logging.getLogger("sglang_cp_hicache.sim")


def _workload_arg(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument(
        "--workload",
        choices=sorted(WORKLOADS),
        default=default,
        help="named preset; it sets the defaults of the options below",
    )


def _chosen_workload(argv: Optional[List[str]]) -> str:
    """``--workload`` alone, read first: the preset gives every other option's default."""
    pre = argparse.ArgumentParser(add_help=False)
    _workload_arg(pre, "default")
    known, _ = pre.parse_known_args(argv)
    return known.workload


def _parser(d: SimConfig) -> argparse.ArgumentParser:
    from sglang_cp_hicache.sim.lines import installed_line_description

    p = argparse.ArgumentParser(
        prog="sglang-cp-hicache-sim",
        description="Replay a workload through CP shared KV + HiCache on N simulated CPU "
        "ranks, verify every cache hit byte for byte, and report the plugin's column beside "
        "upstream's native KV sharding (SGLang 0.5.23 and later) and upstream's unsharded "
        f"cache at cp 1. Runs on the installed line: {installed_line_description()}.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    run = p.add_argument_group("run")
    run.add_argument("--cp-size", type=int, default=d.cp_size, help="simulated CP ranks")
    run.add_argument("--seed", type=int, default=d.seed, help="workload and fault seed")
    run.add_argument("--json", metavar="PATH", help="write the full report as JSON (every column)")
    run.add_argument("--plot", metavar="PATH", help="write a PNG of every column (needs matplotlib)")
    run.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    run.add_argument("--log-level", default=d.log_level, help="logging level of every process")
    run.add_argument("--timeout-s", type=float, default=d.timeout_s,
                     help="gloo timeout and the longest a launch may go without progress (seconds)")  # fmt: skip
    run.add_argument("--fault", choices=sorted(FAULTS), help=argparse.SUPPRESS)  # checker tests

    cols = p.add_argument_group("columns")
    cols.add_argument("--shard-impl", choices=SHARD_IMPLS, default=d.shard_impl,
                      help="the main column: the plugin's sharding, or upstream's native sharding "
                      "alone (0.5.23 only; refused on 0.5.12.post1)")  # fmt: skip
    cols.add_argument("--no-native-column", action="store_true",
                      help="skip the native-sharding column beside a plugin run (it runs only "
                      "on lines with native sharding: 0.5.23)")  # fmt: skip
    cols.add_argument("--no-baseline", action="store_true", help="skip the cp-1 upstream replay")
    cols.add_argument("--pd", action="store_true", default=d.pd,
                      help="PD disaggregation: every finished prefill of the main column is sent "
                      "from its ranks over a real Mooncake engine (loopback TCP) to one decode "
                      "process with a full pool and checked there byte for byte; slower, so off "
                      "by default")  # fmt: skip

    l3 = p.add_argument_group("HiCache L3 storage (0.5.23 line)")
    l3.add_argument("--storage-backend", choices=STORAGE_BACKENDS, default=d.storage_backend,
                    help="attach this L3 backend: the plugin column with owner-free keys (each "
                    "page's owner writes and reads it), the cp-1 upstream column with upstream's "
                    "own; the native column runs without (upstream refuses storage under "
                    "sharding); mooncake starts a mooncake_master on loopback for the run and "
                    "needs --mem-layout page_first")  # fmt: skip
    l3.add_argument("--storage-dir", metavar="DIR", default=d.storage_dir,
                    help="the file backend's folder (a subfolder per column), kept between runs: a "
                    "second run, at any cp size, reads the pages the first one stored (default: "
                    "a temporary folder removed after the run)")  # fmt: skip
    l3.add_argument("--storage-mooncake-master", metavar="HOST:PORT", default=d.storage_mooncake_master,
                    help="mooncake: the plugin column uses this running master and a segment held "
                    "beside it (python -m sglang_cp_hicache.sim.v0_5_23.held_store), so a second "
                    "run, at any cp size, reads the pages the first one stored")  # fmt: skip
    l3.add_argument("--storage-logical-baseline", action="store_true",
                    default=d.storage_logical_baseline,
                    help="also replay upstream cp 1 with cp-size x the per-rank device and host "
                    "pools (the same logical L1 + L2 as the cp ranks together, its own L3 "
                    "folder or master): the fair column for the storage-hit comparison")  # fmt: skip

    work = p.add_argument_group("workload")
    _workload_arg(work, d.workload)
    work.add_argument("--trace", metavar="JSONL", help="replay this trace instead of the generator")
    work.add_argument("--num-requests", type=int, default=d.num_requests, help="generated requests")
    work.add_argument("--batch-size", type=int, default=d.batch_size, help="requests per prefill batch")
    work.add_argument("--num-system-prompts", type=int, default=d.num_system_prompts,
                      help="shared system prompts sessions start from")  # fmt: skip
    work.add_argument("--system-prompt-len", type=int, default=d.system_prompt_len, help="tokens")
    work.add_argument("--turn-len-min", type=int, default=d.turn_len_min, help="tokens per user turn, min")
    work.add_argument("--turn-len-max", type=int, default=d.turn_len_max, help="tokens per user turn, max")
    work.add_argument("--reply-len", type=int, default=d.reply_len,
                      help="tokens of the previous turn's reply in the next prompt")  # fmt: skip
    work.add_argument("--max-prompt-len", type=int, default=d.max_prompt_len,
                      help="a session ends once its next prompt would be longer")  # fmt: skip
    work.add_argument("--max-active-sessions", type=int, default=d.max_active_sessions,
                      help="sessions open at once")  # fmt: skip
    work.add_argument("--continue-prob", type=float, default=d.continue_prob,
                      help="chance the next request continues an open session")  # fmt: skip

    sched = p.add_argument_group("scheduler features")
    sched.add_argument("--chunked-prefill-size", type=int, default=d.chunked_prefill_size,
                       help="tokens per prefill chunk (0: off)")  # fmt: skip
    sched.add_argument("--abort-prob", type=float, default=d.abort_prob,
                       help="chance a request is aborted after admission, before its forward")  # fmt: skip
    sched.add_argument("--retract-prob", type=float, default=d.retract_prob,
                       help="chance a request is retracted after its forward and re-queued")  # fmt: skip
    sched.add_argument("--inflight-steps", type=int, default=d.inflight_steps,
                       help="write acks land this many steps after submission")  # fmt: skip
    sched.add_argument("--all-layer-backup", action="store_true",
                       help="back up new leaves all layers at once at the insert; without it the "
                       "line's default: layer by layer during the forward (0.5.23: the plugin "
                       "column, either host layout; native and upstream always all layers)")  # fmt: skip

    stack = p.add_argument_group("per-rank stack")
    stack.add_argument("--layer-num", type=int, default=d.layer_num, help="KV layers")
    stack.add_argument("--page-size", type=int, default=d.page_size, help="tokens per page")
    stack.add_argument("--physical-tokens", type=int, default=d.physical_tokens,
                       help="device KV pool per rank, in tokens")  # fmt: skip
    stack.add_argument("--hicache-ratio", type=float, default=d.hicache_ratio,
                       help="host pool per rank = ratio x device pool per rank")  # fmt: skip
    stack.add_argument("--io-backend", default=d.io_backend, choices=("direct", "kernel"),
                       help="HiCache I/O backend (None: the line's, direct on 0.5.12.post1, "
                       "kernel on 0.5.23, which requires it)")  # fmt: skip
    stack.add_argument("--mem-layout", default=d.mem_layout,
                       help="HiCache host memory layout (unset: upstream's default, layer_first on "
                       "0.5.12.post1, page_first on 0.5.23; 0.5.23 runs layer_first or page_first)")  # fmt: skip
    stack.add_argument(
        "--draft",
        action="store_true",
        help="the MTP draft's 1-layer NSA pool beside the target's, kept on host with it "
        "(0.5.12.post1: one budget, needs --hicache-ratio large enough for both; 0.5.23: "
        "packed as the host tail layer in the same slots, every column); every hit checks both",
    )
    return p


def _fleet_options(p: argparse.ArgumentParser) -> None:
    from sglang_cp_hicache.sim.fleet.router import ROUTERS

    fleet = p.add_argument_group("fleet (N prefill instances behind one router)")
    fleet.add_argument("--instances", type=int, default=1,
                       help="N > 1: replay the trace on N prefill instances of --cp-size ranks "
                       "each over one shared L3 store and over a store per instance, and print "
                       "the fleet's hit rate by tier and L3 bytes per instance (a page-level "
                       "model of the tiers, no ranks); 1: the single-instance run above")  # fmt: skip
    fleet.add_argument("--router", choices=ROUTERS, default=ROUTERS[0],
                       help="the PD router's prefill policy (cache_aware: the longest device + "
                       "host prefix match, ties in turn)")  # fmt: skip


def _run_fleet(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: SimConfig) -> int:
    from sglang_cp_hicache.sim.fleet.report import compare_fleet, fleet_refusals, format_fleet
    from sglang_cp_hicache.sim.workload import TraceError, load_workload

    problems = fleet_refusals(cfg) + (["--plot draws one instance's columns"] if args.plot else [])
    if problems:
        parser.error(f"--instances {args.instances}: " + "; ".join(problems))
    try:
        comparison = compare_fleet(load_workload(cfg), cfg, args.instances, args.router)
    except (TraceError, ValueError, OSError) as exc:
        parser.error(str(exc))
    print(format_fleet(comparison))
    if args.json:
        comparison.write_json(args.json)
        logger.info("fleet report written to %s", args.json)
    return 0


def config_from_args(args: argparse.Namespace) -> SimConfig:
    return SimConfig(
        cp_size=args.cp_size,
        seed=args.seed,
        workload=args.workload,
        num_requests=args.num_requests,
        num_system_prompts=args.num_system_prompts,
        system_prompt_len=args.system_prompt_len,
        turn_len_min=args.turn_len_min,
        turn_len_max=args.turn_len_max,
        reply_len=args.reply_len,
        max_prompt_len=args.max_prompt_len,
        max_active_sessions=args.max_active_sessions,
        continue_prob=args.continue_prob,
        trace_path=args.trace,
        batch_size=args.batch_size,
        chunked_prefill_size=args.chunked_prefill_size,
        abort_prob=args.abort_prob,
        retract_prob=args.retract_prob,
        inflight_steps=args.inflight_steps,
        per_layer_backup=False if args.all_layer_backup else None,
        layer_num=args.layer_num,
        page_size=args.page_size,
        physical_tokens=args.physical_tokens,
        hicache_ratio=args.hicache_ratio,
        io_backend=args.io_backend,
        mem_layout=args.mem_layout,
        draft=args.draft,
        shard_impl=args.shard_impl,
        native_column=not args.no_native_column,
        baseline=not args.no_baseline,
        pd=args.pd,
        storage_backend=args.storage_backend,
        storage_dir=args.storage_dir,
        storage_mooncake_master=args.storage_mooncake_master,
        storage_logical_baseline=args.storage_logical_baseline,
        progress=not args.no_progress,
        timeout_s=args.timeout_s,
        log_level=args.log_level,
        fault=args.fault,
    )


def parse_args(
    argv: Optional[List[str]] = None,
) -> Tuple[argparse.ArgumentParser, argparse.Namespace]:
    """The parser, its defaults taken from the chosen ``--workload`` preset, and the args."""
    try:
        defaults = SimConfig.preset(_chosen_workload(argv))
    except ValueError:
        defaults = SimConfig()  # the full parser reports the bad choice
    parser = _parser(defaults)
    _fleet_options(parser)
    return parser, parser.parse_args(argv)


def main(argv: Optional[List[str]] = None) -> int:
    parser, args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(levelname)s %(name)s: %(message)s",
    )
    try:
        cfg = config_from_args(args)
    except ValueError as exc:
        parser.error(str(exc))  # exits with 2
    if args.instances < 1:
        parser.error(f"--instances must be >= 1, got {args.instances}")
    if args.instances > 1:
        return _run_fleet(parser, args, cfg)
    if args.plot:
        from sglang_cp_hicache.sim.plot import PlotUnavailable, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailable as exc:
            parser.error(str(exc))

    from sglang_cp_hicache.sim.report.table import format_table
    from sglang_cp_hicache.sim.simulation import run_simulation
    from sglang_cp_hicache.sim.workload import TraceError
    from sglang_cp_hicache.testing.dist import RankFailed

    try:
        report = run_simulation(cfg)
    except (TraceError, ValueError, OSError) as exc:
        parser.error(str(exc))
    except RankFailed as exc:
        logger.error("a simulated rank crashed:\n%s", exc)
        return 1
    print(format_table(report))
    if args.json:
        report.write_json(args.json)
        logger.info("report written to %s", args.json)
    if args.plot:
        from sglang_cp_hicache.sim.plot import write_plot

        write_plot(report, args.plot)
        logger.info("plot written to %s", args.plot)
    return 0 if report.passed else 1


__all__ = ["main", "config_from_args", "parse_args"]
