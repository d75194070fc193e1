"""The soak's faults (``soak.py``), injected at times drawn from a printed seed: the decode
SIGKILLed and restarted (with new routers: a router keeps a restarted worker marked
unavailable), the Mooncake master of the Mooncake-store prefill killed and restarted on
its port, ``/abort_request`` of a request in flight, ``/flush_cache`` under load. Each
fault is counted with what it showed.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

from sglang_cp_hicache.testing.server.client import RequestFailed, generate, post
from sglang_cp_hicache.testing.server.cluster import MooncakeMaster, Router, Server
from sglang_cp_hicache.testing.server.recorder import tokens, wait_settled
from sglang_cp_hicache.testing.server.soak_traffic import ANSWER_BOUND_S, Traffic

logger = logging.getLogger(__name__)

KINDS = ("decode_kill", "master_kill", "abort", "flush")
#: Faults per 10 minutes of soak (at least one each, of the kinds asked for).
PER_10_MIN = {"decode_kill": 2, "master_kill": 2, "abort": 6, "flush": 8}
MASTER_DOWN_S = (10.0, 30.0)
L3_BACK_S = 90.0  # new store objects after the master's restart, or L3 did not come back


@dataclass(frozen=True)
class Fault:
    at_s: float  # seconds after the traffic started
    kind: str


def schedule(seed: int, minutes: float, kinds: Tuple[str, ...]) -> List[Fault]:
    """Faults at seeded times in the middle 80 % of the run, in time order."""
    rng = random.Random(f"{seed}:faults")
    span = minutes * 60.0
    faults = [
        Fault(round(rng.uniform(0.1 * span, 0.8 * span), 1), kind)
        for kind in kinds
        for _ in range(max(1, round(PER_10_MIN[kind] * minutes / 10.0)))
    ]
    return sorted(faults, key=lambda f: f.at_s)


@dataclass
class FaultLog:
    """What each injected fault showed."""

    counts: Counter = field(default_factory=Counter)
    events: List[str] = field(default_factory=list)
    problems: List[str] = field(default_factory=list)

    def event(self, kind: str, text: str) -> None:
        self.counts[kind] += 1
        self.events.append(f"{kind}: {text}")
        logger.warning("soak fault %s", self.events[-1])

    def as_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "events": self.events, "problems": self.problems}


@dataclass
class Targets:
    """What the faults act on; ``restart_decode`` replaces the decode and every router."""

    decode: Callable[[], Server]
    prefills: Callable[[], List[Server]]
    restart_decode: Callable[[], Dict[str, float]]
    master: Optional[MooncakeMaster] = None
    routes: Callable[[], Dict[str, Router]] = dict


class Injector:
    """Runs ``faults`` in order on its own thread while ``traffic`` runs."""

    def __init__(self, faults: List[Fault], targets: Targets, traffic: Traffic, seed: int):
        self.faults = faults
        self.targets = targets
        self.traffic = traffic
        self.rng = random.Random(f"{seed}:injector")
        self.log = FaultLog()
        self.done = threading.Event()

    def run(self, started: float) -> None:
        try:
            for fault in self.faults:
                delay = started + fault.at_s - time.monotonic()
                if delay > 0 and self.traffic.stop.wait(delay):
                    break
                getattr(self, f"_{fault.kind}")()
        except Exception as error:  # a fault that could not be injected fails the soak
            self.log.problems.append(f"injector: {error!r}")
            logger.exception("soak injector")
        finally:
            self.done.set()

    # ------------------------------------------------------------------------ faults
    def _decode_kill(self) -> None:
        decode = self.targets.decode()
        self.traffic.decode_down.set()
        decode.process.kill()
        killed = time.monotonic()
        stuck = self.traffic.gate.close()
        drained = time.monotonic() - killed
        try:
            times = self.targets.restart_decode()
        finally:
            self.traffic.gate.open()
            self.traffic.decode_down.clear()
        if stuck:
            self.log.problems.append(f"decode kill: {stuck} requests unanswered {drained:.0f} s after it")
        self.log.event("decode_kill", f"in-flight requests answered {drained:.1f} s after the SIGKILL; decode and routers back in {max(times.values()):.0f} s")

    def _master_kill(self) -> None:
        master = self.targets.master
        if master is None:
            return
        before = _keys(master)
        master.process.kill()
        master.process.stop()
        down = self.rng.uniform(*MASTER_DOWN_S)
        if self.traffic.stop.wait(down):
            down = 0.0
        master.process.start()
        master.process.wait_ready()
        back = wait_settled(lambda: _keys(master), 1, timeout_s=L3_BACK_S)
        if back <= 0:
            self.log.problems.append(f"master restart: no store object {L3_BACK_S:.0f} s after it (L3 not back)")
        self.log.event("master_kill", f"{before} objects before, down {down:.0f} s, {back} new objects after the restart")

    def _abort(self) -> None:
        """A long streamed request with a known rid, aborted on every server once the
        prefill holds it: the client gets an error (or, aborted too late, its tokens)."""
        routes = self.targets.routes()
        name = self.rng.choice(sorted(routes))
        rid = f"soak-abort-{uuid.uuid4().hex}"
        outcome: Dict[str, object] = {}
        client = threading.Thread(target=_aborted_client, args=(routes[name], rid, outcome), daemon=True)
        client.start()
        time.sleep(self.rng.uniform(0.3, 2.0))
        body = json.dumps({"rid": rid}).encode()
        statuses = [post(server.url, "/abort_request", body)[0] for server in (*self.targets.prefills(), self.targets.decode())]
        client.join(ANSWER_BOUND_S)
        if client.is_alive():
            self.log.problems.append(f"abort {rid} via {name}: no answer within {ANSWER_BOUND_S:.0f} s")
        self.log.event("abort", f"via {name}: /abort_request {sorted(set(statuses))}, client {outcome.get('result', 'no answer')}")

    def _flush(self) -> None:
        results = {server.name: post(server.url, "/flush_cache", b"{}")[0] for server in self.targets.prefills()}
        self.log.event("flush", ", ".join(f"{name} {status}" for name, status in sorted(results.items())))
        bad = {name: status for name, status in results.items() if status not in (200, 400)}
        if bad:
            self.log.problems.append(f"flush under load answered {bad}")


def _aborted_client(router: Router, rid: str, outcome: Dict[str, object]) -> None:
    prompt = tokens(f"soak:abort:{rid}", 600)
    try:
        completion = generate(router.url, prompt, 64, timeout_s=ANSWER_BOUND_S, extra={"rid": rid, "return_logprob": False})
        outcome["result"] = f"served {len(completion.output_ids)} tokens (aborted too late)"
    except RequestFailed as error:
        outcome["result"] = f"HTTP {error.status}" if error.status else f"no status: {str(error)[:80]}"


def _keys(master: MooncakeMaster) -> int:
    try:
        return master.key_count()
    except OSError:
        return -1


__all__ = ["Fault", "FaultLog", "Injector", "KINDS", "Targets", "schedule"]
