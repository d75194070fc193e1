"""A prefill fleet on one Mooncake store (issue 45): two sharded prefills A and B (the
session's TP size, the flag, HiCache, ``page_first`` host pools, ``--hicache-storage-backend
mooncake`` on ONE master; clients use P2PHANDSHAKE, so there is no metadata server to share)
behind ONE PD ``sglang-router`` (``round_robin``) on the session's decode, a second router
over the same two (``cache_aware``, started for its one request), and a one-rank reader
(``--tp 1`` with the flag) behind its own router. Every prefill logs its L3 puts by key and
TP rank (the 0.5.23 runtime's step), so the scenario names each rank's writes.

A request is sent to one prefill through the round-robin router: the router alternates, the
prefill that served each request is read from the prefills' request and prompt-token counters,
and a warm-up request (under one page: nothing cached, nothing stored) moves the turn on when
the wanted prefill served the last one. The scenario (``fleet_shared_l3``) is run by hand
(``--scenarios fleet_shared_l3``): it starts three servers and takes minutes on 2 cores.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Set, Tuple

from sglang_cp_hicache.core.rotation import run_lane_counts
from sglang_cp_hicache.testing.server.client import Completion
from sglang_cp_hicache.testing.server.cluster import MooncakeMaster, Router, Server
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE, PrefillSpec, StorageSpec
from sglang_cp_hicache.testing.server.processes import ManagedProcess, NotReady, ProcessDied
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, flush, full_pages, tokens, wait_settled
from sglang_cp_hicache.testing.server.session import WARM_UP_IDS, ServingSession
from sglang_cp_hicache.testing.server.store_view import (
    StoreView,
    by_page,
    byte_twins,
    logged_puts,
    owner_problems,
    put_by_rank,
)

logger = logging.getLogger(__name__)

A, B, READER = "fleet-a", "fleet-b", "fleet-reader-tp1"
PREFILLS = (A, B)  # behind the fleet's router
SERVED_S = 10.0  # a prefill counts its request by the time the decode's answer is back
PREFIX_PAGES = 8  # even: each of 2 CP ranks owns half, whatever lane the run starts on
SEEN = ("sglang:num_requests_total", "sglang:prompt_tokens_total")
HOLDER = "fleet-segment-holder"
FLUSH_S = 30.0  # a flush refused for pending requests is retried this long


@dataclass(frozen=True)
class FleetPlan:
    """What :meth:`Fleet.start` starts besides the master, A and B: the one-rank reader
    (``reader``); a segment holder mounting ``holder_bytes`` (0: none); the segment each
    prefill rank mounts (``segment_bytes``, None: the harness's default); the fleet
    router's last flags (``router_args``)."""

    reader: bool = True
    holder_bytes: int = 0
    segment_bytes: Optional[int] = None
    router_args: Tuple[str, ...] = ()
    prefill_env: Tuple[Tuple[str, str], ...] = ()  # more environment for A and B


@dataclass
class Fleet:
    """The fleet's processes; :meth:`retire` ends them (the session's cluster checks)."""

    session: ServingSession
    master: MooncakeMaster
    servers: Dict[str, Server]
    router: Router  # round_robin over A and B
    reader_router: Optional[Router]
    store: StoreView
    holder: Optional[ManagedProcess] = None  # the segment holder, if the plan has one
    start_times: Dict[str, float] = field(default_factory=dict)
    last: Optional[str] = None  # the prefill that served the round-robin router's last request

    @classmethod
    def start(cls, session: ServingSession, plan: FleetPlan = FleetPlan()) -> "Fleet":
        cluster = session.cluster
        master = cluster.mooncake_master("fleet-mooncake-master")
        holder: Optional[ManagedProcess] = None
        servers: List[Server] = []
        routers: List[Router] = []
        try:
            if plan.holder_bytes:
                holder = cluster.mooncake_holder(HOLDER, master, plan.holder_bytes)
            storage = StorageSpec("mooncake", mooncake_master=master.address, mooncake_segment_bytes=plan.segment_bytes)
            specs = [
                PrefillSpec(name, tp=session.tp, mem_layout="page_first", storage=storage, l3_puts_logged=True, extra_env=plan.prefill_env)
                for name in PREFILLS
            ]
            if plan.reader:
                specs.append(PrefillSpec(READER, tp=1, mem_layout="page_first", storage=storage, l3_puts_logged=True))
            servers = [cluster.prefill(spec) for spec in specs]
            times = cluster.start(*servers)
            a, b = servers[:2]
            routers = [cluster.router("router-fleet", a, session.decode, also=(b,), policy="round_robin", extra_args=plan.router_args)]
            if plan.reader:
                routers.append(cluster.router(f"router-{READER}", servers[2], session.decode))
            times.update(cluster.start(*routers))
        except BaseException:
            cluster.stop(*routers, *servers, *(p for p in (holder,) if p is not None), master.process)
            raise
        reader_router = routers[1] if plan.reader else None
        return cls(session, master, {s.name: s for s in servers}, routers[0], reader_router, StoreView(master), holder, times)

    def retire(self) -> None:
        self.store.close()
        routers = [r for r in (self.router, self.reader_router) if r is not None]
        holder = [self.holder] if self.holder is not None else []
        self.session.retire(*routers, *self.servers.values(), *holder, self.master.process)

    def live(self) -> List[str]:
        """The names of A and B whose processes run."""
        return [name for name in PREFILLS if self.servers[name].process.running()]

    def flush_live(self, rec: Recorder, servers: Sequence[Server] = ()) -> None:
        """``/flush_cache`` on A and B where live (and on ``servers``), each retried while it
        answers "pending requests" (a request whose KV the decode is still taking, an L3 call
        in flight), at most :data:`FLUSH_S`; a problem naming any that never flushed."""
        for server in [*(self.servers[name] for name in self.live()), *servers]:
            deadline = time.monotonic() + FLUSH_S
            while not flush(server) and time.monotonic() < deadline:
                time.sleep(0.5)
            rec.expect(time.monotonic() < deadline, f"/flush_cache refused on {server.name} for {FLUSH_S:.0f} s")

    # ---------------------------------------------------------------- routing
    def seen(self) -> Dict[str, float]:
        """Requests and prompt tokens each live one of A and B counted (either grows with a
        request; a restarted prefill counts from 0)."""
        metrics = {name: self.servers[name].metrics() for name in self.live()}
        return {name: sum(m.total(counter) for counter in SEEN) for name, m in metrics.items()}

    def served(self, before: Dict[str, float], count: int = 1) -> List[str]:
        """The prefills whose counters grew since ``before``, once ``count`` did (at most
        :data:`SERVED_S` later)."""
        deadline = time.monotonic() + SERVED_S
        while True:
            grown = [name for name, seen in self.seen().items() if seen > before.get(name, 0.0)]
            if len(grown) >= count or time.monotonic() > deadline:
                return grown
            time.sleep(0.2)

    def _served(self, before: Dict[str, float]) -> Optional[str]:
        grown = self.served(before)
        return grown[0] if len(grown) == 1 else None

    def turn_to(self, rec: Recorder, target: str) -> None:
        """Warm-ups through the round-robin router until ``target`` is next (at once when
        it is the only live prefill)."""
        if self.live() == [target]:
            return
        for _ in range(3):
            if self.last is not None and self.last != target:
                return
            before = self.seen()
            rec.ask(self.router, "warm-up (turn)", WARM_UP_IDS, 2)
            self.last = self._served(before)
        rec.expect(False, f"the round-robin router never turned to {target} (last: {self.last})")

    def send(self, rec: Recorder, target: str, label: str, ids: Sequence[int], pair: bool = False, **extra) -> Optional[Completion]:
        """``ids`` to ``target`` through the round-robin router (``pair``: and to the reference,
        compared: :meth:`Recorder.pair`); a problem when another prefill served it."""
        self.turn_to(rec, target)
        before = self.seen()
        answer = rec.pair(label, ids)[0] if pair else rec.ask(self.router, label, ids, **extra)
        self.last = self._served(before)
        rec.expect(self.last == target, f"{label}: served by {self.last}, want {target}")
        return answer

    def wait_writes(self, before: Set[str], at_least: int) -> Set[str]:
        """The keys the store gained since ``before`` once their count settled."""
        wait_settled(lambda: len(self.store.keys() - before), at_least)
        return self.store.keys() - before


# ----------------------------------------------------------------- the scenario
@dataclass
class Marks:
    """Where each fleet prefill's log ended (its puts are read from there on)."""

    lines: Dict[str, int]

    @classmethod
    def now(cls, fleet: Fleet) -> "Marks":
        return cls({name: server.log_lines() for name, server in fleet.servers.items()})

    def puts(self, fleet: Fleet, name: str) -> Dict[int, List[str]]:
        server = fleet.servers[name]
        return put_by_rank(logged_puts(server.process.log_text(), self.lines[name]))


def _owned(tp: int, pages: int) -> Dict[int, int]:
    """Pages each rank owns of a root run of ``pages`` (``pages % tp == 0``: any start lane)."""
    return dict(enumerate(run_lane_counts(0, pages, tp)))


def written_by(rec: Recorder, fleet: Fleet, writer: str, prefix: List[int], label: str = "prefix") -> Set[str]:
    """``prefix`` cold on ``writer`` (and on the reference): its ranks store the full pages,
    each rank its own, each object once; no other live prefill puts any. The keys stored."""
    before, counts, marks = fleet.store.keys(), fleet.store.counts(), Marks.now(fleet)
    fleet.send(rec, writer, f"{label}, cold, on {writer}", prefix, pair=True)
    pages = full_pages(len(prefix)) // PAGE_SIZE
    keys = fleet.wait_writes(before, pages)
    written_now = fleet.store.counts().written - counts.written
    rec.expect(written_now == len(keys), f"{label}: the master wrote {written_now} objects for {writer}'s {len(keys)} new keys")
    rec.expect(len(by_page(keys)) == pages, f"{label}: {writer} stored {len(by_page(keys))} pages, want {pages}")
    for problem in owner_problems(marks.puts(fleet, writer), keys, _owned(fleet.session.tp, pages)):
        rec.expect(False, f"{label}, {writer}'s writes: {problem}")
    for other in fleet.live():
        rec.expect(other == writer or not marks.puts(fleet, other), f"{label}: {other} put objects while {writer} served it")
    per_rank = {rank: len(rank_keys) for rank, rank_keys in marks.puts(fleet, writer).items()}
    stored_pages = len(by_page(keys))
    rec.note(f"{label}: {writer} stored {len(keys)} objects ({stored_pages} pages x {len(keys) // max(1, stored_pages)} components), objects put per rank {per_rank}")
    return keys


def _byte_twin(rec: Recorder, fleet: Fleet, target: str, ids: List[int], first: Dict[str, bytes], label: str) -> None:
    """``ids`` under an ``extra_key`` (another hash chain: other keys, the same KV) on
    ``target`` alone: its objects byte for byte ``first``'s."""
    before = fleet.store.keys()
    fleet.send(rec, target, f"{label}: twin under an extra_key on {target}", ids, extra_key=f"fleet-twin:{label}")
    twin = fleet.wait_writes(before, len(first))
    problem = byte_twins(first, fleet.store.read(twin))
    if rec.expect(problem is None, f"{label}: {target}'s twin objects vs the first writes: {problem}"):
        rec.note(f"{label}: {len(twin)} twin objects on {target}, byte for byte the first writes' ({sum(map(len, first.values()))} bytes)")


def hit_on(rec: Recorder, fleet: Fleet, reader: str, writer: str, prefix: List[int], written: Dict[str, bytes]) -> None:
    """Every live prefill's device and host flushed; ``prefix`` and one new page on
    ``reader``: its storage hit is every page ``writer`` wrote, the answer the reference's
    over the same prefix; ``reader`` stores the new page only; the writer's objects
    unchanged byte for byte."""
    fleet.flush_live(rec)
    before, counts, marks = fleet.store.keys(), fleet.store.counts(), Marks.now(fleet)
    storage_before = fleet.servers[reader].metrics().total("sglang:cached_tokens_total", cache_source="storage")
    request = prefix + tokens(f"fleet:{writer}:next-page", PAGE_SIZE)
    answer = fleet.send(rec, reader, f"{writer}'s prefix + a new page on {reader}, after the flush", request, pair=True)
    want = len(by_page(written)) * PAGE_SIZE
    if answer is not None:
        rec.expect(answer.tier("storage") == want, f"{reader}'s storage hit {answer.cached_by_tier}, want {writer}'s {want} tokens")
    new = fleet.wait_writes(before, 1)
    put = marks.puts(fleet, reader)
    rec.expect(len(by_page(new)) == 1, f"{reader}'s request added {len(by_page(new))} pages to the store, want 1 (the new page)")
    rec.expect(not set(written) & {k for keys in put.values() for k in keys}, f"{reader} put again a page {writer} had stored")
    for problem in owner_problems(put, new):
        rec.expect(False, f"{reader}'s writes: {problem}")
    after = fleet.store.counts()
    written_now, refused = after.written - counts.written, after.refused - counts.refused
    rec.expect((written_now, refused) == (len(new), 0), f"the master wrote {written_now} objects and refused {refused}, want {len(new)} and 0")
    storage = fleet.servers[reader].metrics().total("sglang:cached_tokens_total", cache_source="storage") - storage_before
    rec.note(f"{reader}: storage hit {answer and answer.tier('storage')} tokens of {writer}'s pages ({storage:.0f} in its /metrics); the master wrote {written_now} objects (the new page's), refused {refused}")
    rec.expect(fleet.store.read(written) == written, f"{writer}'s objects changed after {reader}'s read")


def _reader(rec: Recorder, fleet: Fleet, prefix: List[int], written: Set[str]) -> None:
    """The one-rank reader: a storage hit of every page A wrote, no put; its ids over A's
    pages equal to those over its own computation of the prefix (TP 1 vs TP 2 KV: the
    logprobs differ, reported)."""
    router, marks = fleet.reader_router, Marks.now(fleet)
    request = prefix + tokens("fleet:reader:more", 25)
    hit = rec.ask(router, "reader: over A's pages", request)
    cold = rec.ask(router, "reader: own prefix, cold", prefix, extra_key="fleet-reader-own")
    own = rec.ask(router, "reader: own prefix reused", request, extra_key="fleet-reader-own")
    want = len(by_page(written)) * PAGE_SIZE
    if None not in (hit, cold, own):
        rec.expect(hit.tier("storage") == want, f"reader's storage hit {hit.cached_by_tier}, want {want}")
        rec.expect(own.tier("device") >= want, f"reader's own prefix not reused: {own.cached_by_tier}")
        rec.expect(hit.output_ids == own.output_ids, f"reader: ids over A's pages {hit.output_ids} != over its own {own.output_ids}")
        diff = max((abs(x - y) for x, y in zip(hit.logprobs, own.logprobs)), default=0.0)
        rec.note(f"reader: storage hit {hit.tier('storage')} tokens; over A's pages vs its own: logprobs differ by up to {diff:.3g}")
    again = marks.puts(fleet, READER)
    rec.expect(not set(written) & {k for keys in again.values() for k in keys}, "the reader put again a page A had stored")


def _race(rec: Recorder, fleet: Fleet) -> None:
    """One new prompt on A and B at once: both answers the reference's; each instance's ranks
    put their own pages; the master writes one object per key, byte for byte a single
    writer's (its twin under an extra_key)."""
    prompt = tokens("fleet:race", 6 * PAGE_SIZE + 5)
    before, counts, marks = fleet.store.keys(), fleet.store.counts(), Marks.now(fleet)
    fleet.turn_to(rec, A)
    seen = fleet.seen()
    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(lambda side: rec.ask(fleet.router, f"race on {side}", prompt), (A, B)))
    fleet.last = None  # two at once: the next turn is learned again
    served = fleet.served(seen, count=2)
    rec.expect(served == [A, B], f"race: served by {served}, want both {A} and {B}")
    reference = rec.ask(rec.reference, "race: reference", prompt)
    for answer in answers:
        if answer is not None and reference is not None:
            rec.compare("race", answer, reference)
    pages = full_pages(len(prompt)) // PAGE_SIZE
    keys = fleet.wait_writes(before, pages)
    rec.expect(len(by_page(keys)) == pages, f"the race left {len(by_page(keys))} pages, want {pages}")
    put = {name: marks.puts(fleet, name) for name in (A, B)}
    for name in (A, B):  # within each instance, each rank its own pages; together every key
        for problem in owner_problems(put[name], {k for keys in put[name].values() for k in keys}):
            rec.expect(False, f"race, {name}'s writes: {problem}")
    attempted = {k for name in (A, B) for keys in put[name].values() for k in keys}
    rec.expect(attempted == keys, f"race: {len(attempted)} keys put, the store gained {len(keys)}")
    after = fleet.store.counts()
    written_now, refused = after.written - counts.written, after.refused - counts.refused
    rec.expect(written_now == len(keys), f"race: the master wrote {written_now} objects for {len(keys)} keys (one per key)")
    per_rank = ", ".join(f"{name} rank {rank} {len(k)}" for name in (A, B) for rank, k in put[name].items())
    rec.note(f"race: {len(keys)} objects; puts {per_rank}; the master wrote {written_now}, refused {refused} (a key already held or being put)")
    _byte_twin(rec, fleet, B, prompt, fleet.store.read(keys), "race")


def holders(fleet: Fleet, keys: Set[str]) -> Counter:
    """How many of ``keys``' replicas each fleet process's segments hold, by name (the
    prefills' and the holder's logs name their endpoints). Raises OSError/ValueError when
    the master does not answer."""
    processes = {name: server.process for name, server in fleet.servers.items()}
    if fleet.holder is not None:
        processes[fleet.holder.name] = fleet.holder
    return fleet.store.held_by(keys, {name: process.log_text() for name, process in processes.items()})


def _placement(rec: Recorder, fleet: Fleet, keys: Set[str]) -> None:
    """Which prefill's segments hold A's objects: reported, for what a prefill that leaves
    takes along."""
    try:
        rec.note(f"A's prefix objects are held in the segments of: {dict(holders(fleet, keys))}")
    except (OSError, ValueError) as error:
        rec.note(f"placement of A's objects not read: {error!r}")


def _cache_aware(rec: Recorder, fleet: Fleet, prefix: List[int]) -> None:
    """A second router over A and B, ``cache_aware``: the prefix + a new suffix through it;
    whichever prefill it picks, every full page of the prefix is a hit (B's device, or the
    store)."""
    cluster, (a, b) = fleet.session.cluster, (fleet.servers[A], fleet.servers[B])
    router = cluster.router("router-fleet-cache-aware", a, fleet.session.decode, also=(b,), policy="cache_aware")
    answer = None
    try:
        cluster.start(router)
        answer = rec.ask(router, "cache_aware: prefix + a new suffix", prefix + tokens("fleet:aware", 30))
    except (ProcessDied, NotReady) as error:
        rec.expect(False, f"the cache_aware router did not start: {str(error)[:300]}")
    finally:
        fleet.session.retire(router)
    if answer is not None:
        hit = sum(answer.cached_by_tier.values())
        rec.expect(hit >= full_pages(len(prefix)), f"cache_aware: hit {answer.cached_by_tier}, want >= {full_pages(len(prefix))}")
        rec.note(f"cache_aware router: hit by tier {answer.cached_by_tier}")


def fleet_shared_l3(session: ServingSession) -> ScenarioReport:
    """A prefix computed on A is a storage hit on B and on the one-rank reader, answers like
    the reference's; each rank writes its own pages once; a stored page is not written again;
    a race leaves one intact object per key; the store's objects and bytes reported."""
    fleet = Fleet.start(session)
    try:
        rec = Recorder(session, "fleet: shared Mooncake L3 (A, B, reader)", sharded=fleet.router)
        rec.note("fleet started: " + ", ".join(f"{name} {s:.0f} s" for name, s in fleet.start_times.items()))
        prefix = tokens("fleet:prefix", PREFIX_PAGES * PAGE_SIZE + 10)
        written_keys = written_by(rec, fleet, A, prefix)
        written = fleet.store.read(written_keys)
        _placement(rec, fleet, written_keys)
        _byte_twin(rec, fleet, B, prefix, written, "prefix")
        hit_on(rec, fleet, B, A, prefix, written)
        _reader(rec, fleet, prefix, written_keys)
        _race(rec, fleet)
        _cache_aware(rec, fleet, prefix)
        counts = fleet.store.counts()
        rec.note(f"the prefix's {len(written)} objects: {sum(map(len, written.values()))} bytes")
        rec.note(f"store: {counts.objects} objects, {counts.bytes} bytes allocated, {counts.written} written, {counts.refused} puts refused")
        return rec.finish()
    finally:
        fleet.retire()


__all__ = ["A", "B", "Fleet", "FleetPlan", "Marks", "fleet_shared_l3", "hit_on", "holders", "written_by"]
