"""Faults in a prefill fleet on one Mooncake store (issue 45): ``fleet.py``'s A and B (the
session's TP size, the flag, HiCache, Mooncake L3) behind one PD router, with segments that
outlive the prefills.

Mooncake places an object in any mounted segment (measured: A's objects sat in B's, A's and
the reader's segments), so a prefill that dies takes the fleet's pages along. Here the
prefills mount no segment (``global_segment_size`` 0) and a segment holder
(``mooncake_client``, Mooncake's standalone client service) mounts the store's memory: every
object lands there, whichever prefill wrote it.

sglang-router 0.3.2 (measured with stand-in workers and here): with its default health
checks (every 60 s, 3 failures) and the harness's ``--disable-retries``, it keeps sending
every other request to a dead prefill (HTTP 502 ``prefill_server_error``) for minutes; the
fleet router checks health every second (2 failures mark a worker down, 1 success up), so a
dead prefill is out within seconds and the restarted one (same port) is back without being
re-added.

The scenario (``fleet_faults``, by hand): A writes a prefix (every object in the holder's
segment); A SIGKILLed (its whole group): the router sends to B only, B's storage hit is every
page A wrote, answers the reference's; B writes a prefix while A is down; A restarted on its
port: its storage hit is every page B wrote; the master SIGKILLed: requests are served
without L3 (hit 0, one outage line per rank, the plugin's outage counter moves), the master
restarted: new writes reach it and are hits on the other prefill (the reconnect counter
moves); the holder SIGKILLed: its objects are gone, a storage miss served by recompute;
every request bounded; at the end every live server idle, device tokens in use 0 and host
tokens 0 after a flush, no leak warning.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Callable, Dict, List, Optional, Set

from sglang_cp_hicache.testing.server.cluster import Server
from sglang_cp_hicache.testing.server.fleet import A, B, Fleet, FleetPlan, Marks, hit_on, holders, written_by
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, tokens
from sglang_cp_hicache.testing.server.session import ServingSession
from sglang_cp_hicache.testing.server.soak import DEVICE_SETTLE_S, LEAK_LOG, host_used, live_load, settled, wait_idle

#: The fleet router's health checks: every second, 2 failures mark a worker unhealthy (a
#: dead prefill leaves the rotation within ~2 s), 1 success marks it healthy again.
HEALTH_ARGS = (
    "--health-check-interval-secs", "1", "--health-failure-threshold", "2", "--health-success-threshold", "1",
)  # fmt: skip
HOLDER_BYTES = 256 << 20  # the store's memory: far above the scenario's objects
#: ``/health`` answers from the HTTP server alone (SGLang runs a one-token generation per
#: ``/health`` otherwise: with checks every second, a prefill is never idle and a flush
#: races the probes' requests, measured).
HEALTH_ENV = (("SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION", "false"),)
PLAN = FleetPlan(reader=False, holder_bytes=HOLDER_BYTES, segment_bytes=0, router_args=HEALTH_ARGS, prefill_env=HEALTH_ENV)
ROUTER_MARKS_S = 30.0  # the router marks a worker's health change within this
SEGMENT_BACK_S = 30.0  # the holder mounts its segment on a restarted master within this
COUNTER_S = 45.0  # the plugin's L3 counters follow at a stats tick (an idle one: 30 s)
FAULT_REQUEST_S = 60.0  # a request during a fault is answered within this
OUTAGE_LOG = "failed with RPC_FAIL: the master at"
RECONNECT_LOG = "L3 mooncake: the master at"  # "... listens again" (the outage line says it too)
OUTAGES = "sglang:cp_hicache_l3_master_outages_total"
RECONNECTS = "sglang:cp_hicache_l3_master_reconnects_total"


def _poll(read: Callable[[], object], want: Callable[[object], bool], timeout_s: float) -> Optional[float]:
    """Seconds until ``want(read())`` (None after ``timeout_s``)."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if want(read()):
            return time.monotonic() - started
        time.sleep(0.25)
    return None


def router_health(fleet: Fleet) -> Dict[str, bool]:
    """Each prefill's health as the fleet router sees it (its ``GET /workers``), by name."""
    with urllib.request.urlopen(f"{fleet.router.url}/workers", timeout=5.0) as response:
        workers = json.loads(response.read().decode())["workers"]
    by_url = {w["url"]: bool(w["is_healthy"]) for w in workers if w.get("worker_type") == "prefill"}
    return {name: by_url.get(server.url, False) for name, server in fleet.servers.items()}


def _router_marks(rec: Recorder, fleet: Fleet, name: str, healthy: bool, since: float) -> Optional[float]:
    """Seconds from ``since`` (monotonic) until the router marks ``name`` so (None: not
    within :data:`ROUTER_MARKS_S`, a problem)."""
    took = _poll(lambda: router_health(fleet)[name], lambda now: now == healthy, ROUTER_MARKS_S)
    state = "healthy" if healthy else "unhealthy"
    rec.expect(took is not None, f"the router did not mark {name} {state} within {ROUTER_MARKS_S:.0f} s")
    return None if took is None else round(time.monotonic() - since, 1)


def _timed(rec: Recorder, label: str, send: Callable[[], object]) -> object:
    """``send()``'s answer; a problem when it took over :data:`FAULT_REQUEST_S`."""
    started = time.monotonic()
    answer = send()
    took = time.monotonic() - started
    rec.expect(took <= FAULT_REQUEST_S, f"{label}: answered after {took:.1f} s, bound {FAULT_REQUEST_S:.0f} s")
    rec.note(f"{label}: answered in {took:.1f} s")
    return answer


# ----------------------------------------------------------------------- the faults
def _in_the_holder(rec: Recorder, fleet: Fleet, keys: Set[str], label: str) -> None:
    """Every replica of ``keys`` in the holder's segment (none in a prefill's)."""
    try:
        placed = holders(fleet, keys)
    except (OSError, ValueError) as error:
        rec.expect(False, f"{label}: placement not read: {error!r}")
        return
    rec.expect(set(placed) == {fleet.holder.name}, f"{label}: objects held by {dict(placed)}, want all in {fleet.holder.name}")
    rec.note(f"{label}: {sum(placed.values())} objects, held by {dict(placed)}")


def _prefill_killed(rec: Recorder, fleet: Fleet, prefix: List[int], written: Dict[str, bytes]) -> None:
    """A SIGKILLed (its whole group): the router marks it down; requests go to B, whose
    storage hit is every page A wrote; A's objects unchanged."""
    a, killed = fleet.servers[A], time.monotonic()
    a.process.kill()
    a.process.stop()  # reaps the group; raises naming any member still there
    took = _router_marks(rec, fleet, A, healthy=False, since=killed)
    rec.note(f"{A} SIGKILLed: the router marked it unhealthy {took} s after the kill")
    fleet.last = None
    for i in range(3):  # the router's whole rotation goes to B now
        before = fleet.seen()
        _timed(rec, f"A down, request {i}", lambda: rec.ask(fleet.router, f"A down {i}", tokens(f"faults:a-down:{i}", 40), 2))
        served = fleet.served(before)
        rec.expect(served == [B], f"A down, request {i}: served by {served}, want {B}")
    hit_on(rec, fleet, B, A, prefix, written)
    rec.expect(fleet.store.read(written) == written, "A's objects changed or went with A")


def _prefill_back(rec: Recorder, fleet: Fleet) -> None:
    """B writes a prefix while A is down; A restarted on its port, back in the router's
    rotation: its storage hit is every page B wrote."""
    prefix = tokens("faults:b-prefix", 8 * PAGE_SIZE + 10)
    keys = written_by(rec, fleet, B, prefix, "B's prefix, A down")
    _in_the_holder(rec, fleet, keys, "B's prefix")
    written = fleet.store.read(keys)
    a = fleet.servers[A]
    a.process.start()
    ready = a.process.wait_ready()
    took = _router_marks(rec, fleet, A, healthy=True, since=time.monotonic())
    rec.note(f"{A} restarted on port {a.endpoint.port} in {ready:.0f} s; the router marked it healthy {took} s after its /health answered")
    fleet.last = None
    hit_on(rec, fleet, A, B, prefix, written)


def _a_miss_on_b(rec: Recorder, fleet: Fleet, label: str, prefix: List[int]) -> None:
    """The live prefills flushed; ``prefix`` (stored, now out of reach) on B: answered within
    :data:`FAULT_REQUEST_S`, a storage hit of 0 (served by recompute), the reference's answer."""
    fleet.flush_live(rec)
    answer = _timed(rec, label, lambda: fleet.send(rec, B, label, prefix, pair=True))
    if answer is not None:
        rec.expect(answer.tier("storage") == 0, f"{label}: storage hit {answer.cached_by_tier}, want 0")
        rec.note(f"{label}: hit by tier {answer.cached_by_tier}")


def _logged(fleet: Fleet, name: str, marks: Marks, text: str) -> List[str]:
    """The lines of ``name``'s log holding ``text`` since ``marks``."""
    return [line for line in fleet.servers[name].process.log_text().splitlines()[marks.lines[name]:] if text in line]


def _counter(server: Server, name: str) -> float:
    return server.metrics().total(name)


def _master_restarted(rec: Recorder, fleet: Fleet) -> None:
    """The master SIGKILLed: B serves a prefix it stored without L3 (hit 0, the answer the
    reference's), one outage line per rank at most, the outage counter moves; the master
    restarted on its ports: the holder mounts again, A's new writes reach it and are B's
    storage hits (the reconnect counter moves)."""
    prefix = tokens("faults:pre-outage", 6 * PAGE_SIZE + 10)
    stored = written_by(rec, fleet, B, prefix, "before the outage")
    b, marks = fleet.servers[B], Marks.now(fleet)
    outages, reconnects = _counter(b, OUTAGES), _counter(b, RECONNECTS)
    fleet.store.close()  # its client joined the old master
    fleet.master.process.kill()
    fleet.master.process.stop()
    _a_miss_on_b(rec, fleet, f"master down: {len(stored)} objects B stored unreachable", prefix)
    lines = _logged(fleet, B, marks, OUTAGE_LOG)
    rec.expect(1 <= len(lines) <= fleet.session.tp, f"master down: {len(lines)} outage lines in {B}'s log, want 1 to {fleet.session.tp} (one per rank)")
    took = _poll(lambda: _counter(b, OUTAGES), lambda now: now > outages, COUNTER_S)
    rec.expect(took is not None, f"{OUTAGES} on {B} stayed {outages:.0f}")
    rec.note(f"master down: {len(lines)} outage line(s) in {B}'s log; {OUTAGES} {outages:.0f} -> {_counter(b, OUTAGES):.0f}")
    fleet.master.process.start()
    fleet.master.process.wait_ready()
    back = _poll(fleet.store.segments, bool, SEGMENT_BACK_S)
    rec.expect(back is not None, f"the holder mounted no segment on the restarted master within {SEGMENT_BACK_S:.0f} s")
    rec.note(f"master restarted: segments {fleet.store.segments()} after {back if back is None else round(back, 1)} s")
    prefix = tokens("faults:post-outage", 8 * PAGE_SIZE + 10)
    keys = written_by(rec, fleet, A, prefix, "after the master's restart")
    _in_the_holder(rec, fleet, keys, "after the master's restart")
    hit_on(rec, fleet, B, A, prefix, fleet.store.read(keys))
    again = _logged(fleet, B, marks, RECONNECT_LOG)
    rec.expect(1 <= len(again) <= fleet.session.tp, f"master back: {len(again)} reconnect lines in {B}'s log, want 1 to {fleet.session.tp}")
    took = _poll(lambda: _counter(b, RECONNECTS), lambda now: now > reconnects, COUNTER_S)
    rec.expect(took is not None, f"{RECONNECTS} on {B} stayed {reconnects:.0f}")
    rec.note(f"master back: {len(again)} reconnect line(s) in {B}'s log; {RECONNECTS} {reconnects:.0f} -> {_counter(b, RECONNECTS):.0f}")
    on_a = (len(_logged(fleet, A, marks, OUTAGE_LOG)), len(_logged(fleet, A, marks, RECONNECT_LOG)))
    rec.note(f"{A} (no L3 call while the master was down): {on_a[0]} outage and {on_a[1]} reconnect line(s) since the kill")


def _holder_killed(rec: Recorder, fleet: Fleet) -> None:
    """The segment holder SIGKILLed: the objects it held are gone; a stored prefix is a
    storage miss served by recompute (the reference's answer), within the bound."""
    prefix = tokens("faults:pre-holder", 6 * PAGE_SIZE + 10)
    written_by(rec, fleet, A, prefix, "before the holder's kill")
    fleet.holder.kill()
    fleet.holder.stop()
    _a_miss_on_b(rec, fleet, "holder gone: the objects A stored", prefix)


def _nothing_leaked(rec: Recorder, fleet: Fleet, marks: Dict[str, int]) -> None:
    """The decode, the live fleet prefills and the reference idle; after a flush device
    tokens in use 0 and host tokens in use 0 on every rank published; no ``memory leak
    detected`` since ``marks`` (the session's servers) or since their start (the fleet's)."""
    prefills = [fleet.servers[name] for name in fleet.live()] + [fleet.session.reference]  # it answered every pair
    servers = [fleet.session.decode, *prefills]
    busy = wait_idle(servers)
    rec.expect(not busy, f"still holding requests: {busy}")
    fleet.flush_live(rec, [fleet.session.reference])
    devices = {}
    for server in servers:
        device = devices[server.name] = settled(lambda: live_load(server)["num_used_tokens"], 0, DEVICE_SETTLE_S)
        rec.expect(device == 0, f"{server.name}: {device} device tokens in use after a flush")
        since = marks.get(server.name, 0)
        leaks = [line for line in server.process.log_text().splitlines()[since:] if LEAK_LOG in line]
        rec.expect(not leaks, f"{server.name}: {len(leaks)} leak warnings, e.g. {leaks[:1]}")
    hosts = {}
    for server in prefills:
        host = settled(lambda: host_used(server), {rank: 0.0 for rank in host_used(server)})
        hosts[server.name] = host
        rec.expect(host and not any(host.values()), f"{server.name}: host tokens in use after a flush {host}")
    rec.note(f"after the faults and a flush: device tokens in use {devices}, host tokens in use {hosts} (per rank published)")


def fleet_faults(session: ServingSession) -> ScenarioReport:
    """A prefill killed and restarted, the master restarted, the segment holder killed, in
    a fleet whose segments live in a holder; nothing hangs, nothing leaks."""
    marks = {server.name: server.log_lines() for server in (session.decode, session.reference)}
    fleet = Fleet.start(session, PLAN)
    try:
        rec = Recorder(session, "fleet faults: prefill, master, holder", sharded=fleet.router)
        rec.note("fleet started: " + ", ".join(f"{name} {s:.0f} s" for name, s in fleet.start_times.items()))
        prefix = tokens("faults:a-prefix", 8 * PAGE_SIZE + 10)
        keys = written_by(rec, fleet, A, prefix, "A's prefix")
        _in_the_holder(rec, fleet, keys, "A's prefix")
        _prefill_killed(rec, fleet, prefix, fleet.store.read(keys))
        _prefill_back(rec, fleet)
        _master_restarted(rec, fleet)
        _holder_killed(rec, fleet)
        _nothing_leaked(rec, fleet, marks)
        return rec.finish()
    finally:
        fleet.retire()


__all__ = ["HEALTH_ARGS", "PLAN", "fleet_faults", "router_health"]
