"""``scripts/serve_cpu.sh --soak MINUTES``: concurrent multi-turn traffic against the sharded
prefill's router, its reference's and a Mooncake-store sharded prefill's, while faults are
injected at times drawn from a printed seed (``soak_faults.py``), and what must hold after:

* every request answered (tokens) or failed with an HTTP error within
  ``soak_traffic.ANSWER_BOUND_S``; none hung, none left without a status (but a stream a
  killed decode cuts after its HTTP 200, counted as that fault's);
* every server idle again by its own accounting (``/v1/loads``), device tokens in use
  (held by requests) back to their idle value, no ``memory leak detected`` from SGLang's
  own idle check of its pools on any rank, and host tokens in use per rank after a
  ``/flush_cache`` back to their idle value;
* a probe answers exactly as the reference, like with like (both cold, then both over the
  same device prefix);
* nothing the soak started is left running.

The report counts every outcome and fault. The CI form (``soak_short``) runs it for a
minute and a half against the serving module's cluster.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

from sglang_cp_hicache.testing.server.cluster import PD_BOOTSTRAP_TIMEOUT_S, Router, Server
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE, PrefillSpec, StorageSpec
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.processes import http_json
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, flush, tokens
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession
from sglang_cp_hicache.testing.server.soak_faults import KINDS, Injector, Targets, schedule
from sglang_cp_hicache.testing.server.soak_traffic import ANSWER_BOUND_S, Traffic, conversations

logger = logging.getLogger(__name__)

MOONCAKE = "mooncake"
HOST_USED = "sglang:hicache_host_used_tokens"
LEAK_LOG = "memory leak detected"  # SGLang's own idle check of its pools
IDLE_S = PD_BOOTSTRAP_TIMEOUT_S + 30.0  # a request orphaned by a dead decode is freed by then
GAUGE_REFRESH_S = 32.0  # an idle scheduler refreshes its Prometheus gauges every 30 s
METRICS_S = 75.0
DEVICE_SETTLE_S = 30.0  # an idle server's last request ends well within it
T = TypeVar("T")


@dataclass(frozen=True)
class SoakConfig:
    minutes: float
    seed: int
    concurrency: int = 8
    faults: Tuple[str, ...] = KINDS
    conversations_per_router: int = 4


@dataclass
class SoakReport:
    config: SoakConfig
    schedule: List[str] = field(default_factory=list)
    traffic: dict = field(default_factory=dict)
    faults: dict = field(default_factory=dict)
    accounting: Dict[str, str] = field(default_factory=dict)
    probe: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def as_dict(self) -> dict:
        return {**self.__dict__, "config": self.config.__dict__, "ok": self.ok}


# ----------------------------------------------------------------------- accounting
PerRank = Dict[int, float]


def live_load(server: Server) -> dict:
    """``server``'s own accounting right now (``/v1/loads``, its scheduler's snapshot; the
    Prometheus gauges refresh only every 30 s of idleness)."""
    return http_json(f"{server.url}/v1/loads?include=core,disagg")["loads"][0]


def requests_held(load: dict) -> int:
    """Requests a server holds: running, waiting (its PD queues included), in flight."""
    disagg = load.get("disaggregation") or {}
    return load["num_running_reqs"] + load["num_waiting_reqs"] + disagg.get("prefill_inflight_queue_reqs", 0)


def host_used(server: Server) -> PerRank:
    return Metrics.fetch(server.url).per_rank(HOST_USED)


def settled(read: Callable[[], T], want: T, timeout_s: float = METRICS_S) -> T:
    """``read()`` once it equals ``want`` (else its value after ``timeout_s``): a leaked
    slot stays, a request still finishing lets go (a prefill's request between chunks, or
    in a batch whose result is not processed yet, is in none of the queues ``/v1/loads``
    counts: a disconnected client's prompt can still be in prefill when the idle wait
    returns)."""
    deadline = time.monotonic() + timeout_s
    now = read()
    while now != want and time.monotonic() < deadline:
        time.sleep(2.0)
        now = read()
    return now


@dataclass
class Accounting:
    """Idle values per server: device tokens in use (held by requests: capacity - free -
    evictable, whatever the cache keeps), host tokens in use per rank after a
    ``/flush_cache``, and where each log ended (for SGLang's own idle check of its pools on
    every rank, which logs ``memory leak detected``)."""

    device: Dict[str, int] = field(default_factory=dict)
    host: Dict[str, PerRank] = field(default_factory=dict)
    marks: Dict[str, int] = field(default_factory=dict)

    @classmethod
    def idle(cls, servers: List[Server], prefills: List[Server]) -> "Accounting":
        """Taken on idle servers whose host gauges were refreshed since their last flush."""
        taken = cls({s.name: live_load(s)["num_used_tokens"] for s in servers}, marks={s.name: s.log_lines() for s in servers})
        taken.host = {server.name: host_used(server) for server in prefills}
        return taken

    def check(self, servers: List[Server], prefills: List[Server], report: "SoakReport") -> None:
        """Compare each server with its idle values (device first: a flush frees all)."""
        for server in servers:
            device = settled(lambda: live_load(server)["num_used_tokens"], self.device[server.name], DEVICE_SETTLE_S)
            leaks = [line for line in server.process.log_text().splitlines()[self.marks[server.name]:] if LEAK_LOG in line]
            report.accounting[server.name] = f"device in use {device} (idle {self.device[server.name]}), {len(leaks)} leak warnings"
            if device != self.device[server.name]:
                report.problems.append(f"{server.name}: {device} device tokens in use after the soak, idle {self.device[server.name]} (a leaked slot)")
            report.problems += [f"{server.name}: {line.strip()[:200]}" for line in leaks[:5]]
        for server in prefills:
            if not flush(server):
                report.problems.append(f"/flush_cache refused on {server.name} after the soak")
            host = settled(lambda: host_used(server), self.host[server.name])
            report.accounting[server.name] += f", host in use after a flush {host} (idle {self.host[server.name]})"
            if host != self.host[server.name]:
                report.problems.append(f"{server.name}: host tokens in use {host} after a flush, idle {self.host[server.name]}")


def wait_idle(servers: List[Server], timeout_s: float = IDLE_S) -> List[str]:
    """Wait until no server holds a request; the names of those that still do."""
    deadline = time.monotonic() + timeout_s
    busy = [s.name for s in servers if requests_held(live_load(s))]
    while busy and time.monotonic() < deadline:
        time.sleep(2.0)
        busy = [s.name for s in servers if requests_held(live_load(s))]
    return busy


# ------------------------------------------------------------------------- the run
class MooncakePrefill:
    """The Mooncake-store sharded prefill, its router and its master; its router is
    replaced with the decode's."""

    def __init__(self, session: ServingSession):
        self.session = session
        self.master = session.cluster.mooncake_master("soak-mooncake-master")
        storage = StorageSpec("mooncake", mooncake_master=self.master.address)
        spec = PrefillSpec("soak-mooncake", tp=session.tp, mem_layout="page_first", storage=storage)
        try:
            servers, routers, _ = session.behind_routers(spec)
        except BaseException:
            session.retire(self.master.process)
            raise
        self.server, self.router = servers[0], routers[0]

    def new_router(self) -> None:
        cluster = self.session.cluster
        cluster.stop(self.router)
        self.router = cluster.router(self.router.name, self.server, self.session.decode)
        cluster.start(self.router)

    def retire(self) -> None:
        self.session.retire(self.router, self.server, self.master.process)


def _routes(session: ServingSession, mooncake: Optional[MooncakePrefill]) -> Dict[str, Router]:
    routes = {SHARDED: session.sharded_router, REFERENCE: session.reference_router}
    if mooncake is not None:
        routes[MOONCAKE] = mooncake.router
    return routes


def _restart_decode(session: ServingSession, mooncake: Optional[MooncakePrefill]) -> Dict[str, float]:
    times = session.restart_decode()
    if mooncake is not None:
        started = time.monotonic()
        mooncake.new_router()
        times[mooncake.router.name] = time.monotonic() - started
    return times


def _servers(session: ServingSession, mooncake: Optional[MooncakePrefill]) -> List[Server]:
    """The decode, then every prefill the soak sends to (read anew: the decode changes)."""
    return [session.decode, session.sharded, session.reference] + ([mooncake.server] if mooncake else [])


def _drive(session: ServingSession, config: SoakConfig, mooncake: Optional[MooncakePrefill], report: SoakReport) -> None:
    """Traffic for ``config.minutes`` with the faults; returns once every worker stopped."""

    def routes() -> Dict[str, Router]:
        return _routes(session, mooncake)

    traffic = Traffic(routes, conversations(config.seed, dict.fromkeys(routes(), config.conversations_per_router)), config.seed, config.concurrency)
    targets = Targets(
        decode=lambda: session.decode,
        prefills=lambda: _servers(session, mooncake)[1:],
        restart_decode=lambda: _restart_decode(session, mooncake),
        master=mooncake.master if mooncake else None,
        routes=routes,
    )
    faults = schedule(config.seed, config.minutes, config.faults)
    report.schedule = [f"{f.at_s:.0f} s {f.kind}" for f in faults]
    print(f"soak: seed {config.seed}, {config.minutes:g} min, concurrency {config.concurrency}; faults at " + ", ".join(report.schedule), flush=True)
    injector = Injector(faults, targets, traffic, config.seed)
    workers = traffic.start()
    thread = threading.Thread(target=injector.run, args=(time.monotonic(),), daemon=True)
    thread.start()
    traffic.stop.wait(config.minutes * 60.0)
    injector.done.wait(ANSWER_BOUND_S * 2)  # a fault under way finishes
    traffic.stop.set()
    for worker in workers:
        worker.join(ANSWER_BOUND_S + 10.0)
    report.problems += [f"worker {w.name} still running" for w in workers if w.is_alive()]
    report.traffic, report.faults = traffic.tally.as_dict(), injector.log.as_dict()
    report.problems += injector.log.problems
    report.problems += [f"{n} x {kind}" for kind, n in traffic.tally.counts.items() if _unanswered(kind)]
    report.problems += [f"{n} x {kind}" for kind, n in traffic.tally.counts.items() if "_unexpected_" in kind]


def _unanswered(kind: str) -> bool:
    """A request that hung, or failed without an HTTP status outside a decode's death (a
    stream the decode's death cuts has had its HTTP 200 already)."""
    return kind.endswith("_hung") or (kind.endswith("_no_answer") and "_decode_kill_" not in kind)


def _check_accounting(servers: List[Server], prefills: List[Server], idle: Accounting, report: SoakReport) -> None:
    busy = wait_idle(servers)
    report.problems += [f"{name} still holds requests {IDLE_S:.0f} s after the traffic" for name in busy]
    idle.check(servers, prefills, report)


def _probe(session: ServingSession, seed: int, report: SoakReport) -> None:
    """A prompt never sent, cold on both sides, then extended over its device pages."""
    recorder = Recorder(session, "soak probe")
    prompt = tokens(f"soak:probe:{seed}", 5 * PAGE_SIZE + 11)
    recorder.pair("probe, cold", prompt, cold=True)
    recorder.pair("probe, over its device pages", prompt + tokens(f"soak:probe:{seed}:more", 37))
    result: ScenarioReport = recorder.finish()
    report.probe = [f"{result.requests} requests, identical: {result.identical}"] + result.mismatches
    report.problems += result.mismatches + result.problems


def soak(session: ServingSession, config: SoakConfig) -> SoakReport:
    """The soak against ``session``'s cluster (with a Mooncake-store prefill of its own
    when the master fault is asked for); the report says what held."""
    if not session.line.supports_storage_under_flag:  # no Mooncake store under the flag
        config = replace(config, faults=tuple(k for k in config.faults if k != "master_kill"))
    report = SoakReport(config)
    started = time.monotonic()
    busy = wait_idle(_servers(session, None))  # what ran before (a decode's PD wait) ends
    report.problems += [f"{name} still holds requests {IDLE_S:.0f} s before the soak" for name in busy]
    for server in (session.sharded, session.reference):
        flush(server)  # their host gauges refresh within 30 s of idleness
    mooncake = MooncakePrefill(session) if "master_kill" in config.faults else None
    if mooncake is None:
        time.sleep(GAUGE_REFRESH_S)
    try:
        idle = Accounting.idle(_servers(session, mooncake), _servers(session, mooncake)[1:])
        _drive(session, config, mooncake, report)
        servers = _servers(session, mooncake)
        _check_accounting(servers, servers[1:], idle, report)
        _probe(session, config.seed, report)
    finally:
        if mooncake is not None:
            mooncake.retire()
    report.wall_s = round(time.monotonic() - started, 1)
    return report


def soak_table(report: SoakReport) -> str:
    """The report as lines a person reads."""
    lines = [f"soak: seed {report.config.seed}, {report.config.minutes:g} min, wall {report.wall_s:.0f} s: {'PASS' if report.ok else 'FAIL'}"]
    lines.append("faults scheduled: " + ", ".join(report.schedule))
    lines += [f"  {kind:<40} {n:>6}" for kind, n in report.traffic.get("counts", {}).items()]
    lines.append(f"  longest answer {report.traffic.get('longest_s', 0)} s (bound {ANSWER_BOUND_S:.0f} s)")
    lines += [f"  fault {event}" for event in report.faults.get("events", [])]
    lines += [f"  tokens in use {name}: {text}" for name, text in report.accounting.items()]
    lines += [f"  probe: {text}" for text in report.probe]
    lines += [f"  ! {problem}" for problem in report.problems]
    return "\n".join(lines)


#: The CI form: the faults the serving module's other scenarios do not already cover
#: (``decode_killed`` kills the decode mid-request), on a minute and a half of traffic.
SHORT = SoakConfig(minutes=1.5, seed=42, concurrency=8, faults=("master_kill", "abort", "flush"))


def soak_short(session: ServingSession) -> ScenarioReport:
    """:data:`SHORT` against the serving module's cluster, as a scenario report."""
    report = soak(session, SHORT)
    counts = report.traffic.get("counts", {})
    return ScenarioReport(
        f"soak ({SHORT.minutes:g} min, seed {SHORT.seed})",
        requests=sum(counts.values()),
        problems=list(report.problems),
        notes=soak_table(report).splitlines()[1:],
        wall_s=report.wall_s,
    )


def run_soak(run_dir: Path, model: Path, tp: int, config: SoakConfig, json_path: Optional[Path] = None) -> int:
    """The CLI's ``--soak``: the main cluster started, soaked, ended and checked gone; 0
    when everything held."""
    session = ServingSession.start(run_dir, model, tp=tp)
    try:
        print(f"cluster ready ({', '.join(f'{n} {s:.0f} s' for n, s in session.start_times.items())})", flush=True)
        report = soak(session, config)
    finally:
        session.close()
    leftover = session.running()
    if leftover:
        report.problems.append(f"processes still running: {leftover}")
    print(soak_table(report))
    if json_path is not None:
        json_path.write_text(json.dumps(report.as_dict(), indent=1, default=str))
    print(f"logs in {run_dir / 'logs'}")
    return 0 if report.ok else 1


__all__ = ["SHORT", "SoakConfig", "SoakReport", "run_soak", "soak", "soak_short", "soak_table"]
