"""Upstream's cache series (``--enable-metrics``) of the sharded prefill against its unsharded
reference's, for the same requests, read from both servers' ``/metrics`` by the serving
scenarios (``docs/metrics.md``, "Upstream's cache metrics under sharding").

A :class:`CacheMetricsWindow` brackets a stretch of requests both servers serve alike: it
waits until both servers' counters are still (write-through and L3 backups finish after the
answer), reads every series, and after the stretch reads them again and compares the
deltas by each series' relation:

* **logical**: every CP rank of the sharded server moved by what the reference's rank 0
  moved (an unsharded CP rank does the whole logical work too);
* **physical**: the sharded CP ranks together moved by what one reference rank moved (each
  unsharded CP rank holds and moves the whole KV; each sharded rank its owned pages).

Then ``sglang:cache_hit_rate`` (a gauge: the last prefill batch's hit fraction, set by
upstream's ``report_prefill_stats`` on the stats-logging rank: CP rank 0) against the last
``Prefill batch`` line each server logged, and against each other; and, after a sub-page
probe (a prefill batch that refreshes the host gauges and backs nothing up), the host tier's
used and total tokens.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.testing.server.cluster import Server
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.recorder import Recorder, flush, full_pages, tokens

LOGICAL = "logical"
PHYSICAL = "physical"
SETTLE_S = 60.0
STILL_S = 2.0
_BATCH = re.compile(r"Prefill batch.*#new-token: (\d+), #cached-token: (\d+)")


@dataclass(frozen=True)
class Relation:
    """One upstream series and how the sharded server's delta relates to the reference's."""

    name: str
    kind: str  # LOGICAL or PHYSICAL
    labels: Tuple[Tuple[str, str], ...] = ()
    moves: bool = True  # the stretch must move it (else 0 == 0 would prove nothing)
    rank_label: str = "tp_rank"  # upstream's storage series: attn_cp_rank (tp_rank 0 on each)

    def label(self) -> str:
        return self.name + ("{" + ",".join(f'{k}="{v}"' for k, v in self.labels) + "}" if self.labels else "")

    def delta(self, after: Metrics, before: Metrics) -> Dict[int, float]:
        a = after.per_rank(self.name, self.rank_label, **dict(self.labels))
        b = before.per_rank(self.name, self.rank_label, **dict(self.labels))
        return {rank: a[rank] - b.get(rank, 0.0) for rank in sorted(a)}


KV = (("pool", "kv"),)
_STORAGE = "attn_cp_rank"
#: L2 backup, load-back and device eviction (the host_load_back stretch: every one moves).
#: A per-layer backup acks one timed op per forward that writes full pages; upstream merges
#: a batch's inserts into one op per forward too: the op counts are equal.
L2_SERIES: Tuple[Relation, ...] = (
    Relation("sglang:hicache_backup_tokens_total", LOGICAL, KV),
    Relation("sglang:hicache_backup_bytes_total", PHYSICAL),
    Relation("sglang:hicache_backup_duration_seconds_count", LOGICAL),
    Relation("sglang:load_back_tokens_total", LOGICAL, KV),
    Relation("sglang:load_back_bytes_total", PHYSICAL),
    Relation("sglang:load_back_duration_seconds_count", LOGICAL),
    Relation("sglang:evicted_tokens_total", LOGICAL),
    Relation("sglang:eviction_duration_seconds_count", LOGICAL),
    Relation("sglang:hicache_dropped_tokens_total", LOGICAL, moves=False),
    Relation("sglang:backuped_tokens_total", LOGICAL, rank_label=_STORAGE),  # host -> L3
)
#: An L3 hit on both servers (each flushed, each reading its own tier).
STORAGE_SERIES: Tuple[Relation, ...] = (
    Relation("sglang:storage_prefetch_hit_tokens_total", LOGICAL, rank_label=_STORAGE),
    Relation("sglang:prefetched_tokens_total", LOGICAL, rank_label=_STORAGE),
    Relation("sglang:storage_prefetch_unfulfilled_tokens_total", LOGICAL, moves=False, rank_label=_STORAGE),
    Relation("sglang:load_back_tokens_total", LOGICAL, KV),
    Relation("sglang:load_back_bytes_total", PHYSICAL),
    Relation("sglang:load_back_duration_seconds_count", LOGICAL),
)


#: The L3 backend's own per-batch stats (upstream's ``get_stats``: the Mooncake store's; the
#: file backend reports none): each rank's batch reads its owned pages, once.
PREFETCH_PAGES = Relation("sglang:prefetch_pgs_sum", PHYSICAL, rank_label="attn_cp_rank")


def _still(servers: Sequence[Server], relations: Sequence[Relation]) -> List[Metrics]:
    """Both servers' metrics once the series of ``relations`` stopped moving for
    :data:`STILL_S` (bounded by :data:`SETTLE_S`)."""
    deadline = time.monotonic() + SETTLE_S
    last, since = None, time.monotonic()
    while True:
        read = [server.metrics() for server in servers]
        figure = [tuple(m.per_rank(r.name, r.rank_label, **dict(r.labels)).items()) for m in read for r in relations]
        if figure != last:
            last, since = figure, time.monotonic()
        elif time.monotonic() - since >= STILL_S or time.monotonic() > deadline:
            return read
        time.sleep(0.25)


def compare(relations: Sequence[Relation], sharded: Tuple[Metrics, Metrics], reference: Tuple[Metrics, Metrics], cp: int) -> Tuple[List[str], List[str]]:
    """(problems, figures) of ``relations`` over the sharded and the reference's
    (after, before) readings."""
    problems, figures = [], []
    for relation in relations:
        ours, theirs = relation.delta(*sharded), relation.delta(*reference)
        want = theirs.get(0, 0.0)
        figures.append(f"{relation.label()} sharded {'/'.join(f'{v:.12g}' for v in ours.values())} ref {want:.12g}")
        if relation.moves and want <= 0:
            problems.append(f"{relation.label()}: the reference's did not move ({theirs})")
        if len(ours) != cp and (want != 0 or ours):
            problems.append(f"{relation.label()}: sharded ranks {sorted(ours)}, wanted {cp} CP ranks")
        elif relation.kind == LOGICAL and any(v != want for v in ours.values()):
            problems.append(f"{relation.label()} (logical): sharded per CP rank {ours} != the reference's {want:g}")
        elif relation.kind == PHYSICAL and sum(ours.values()) != want:
            problems.append(f"{relation.label()} (physical): sharded ranks sum {sum(ours.values()):g} {ours} != the reference's {want:g}")
    return problems, figures


def last_batch_hit_rate(server: Server, since_line: int) -> Optional[float]:
    """The hit fraction of the last ``Prefill batch`` line ``server``'s stats-logging rank
    logged after ``since_line`` (``#cached-token / (#new-token + #cached-token)``)."""
    lines = server.process.log_text().splitlines()[since_line:]
    batches = [m for m in map(_BATCH.search, lines) if m is not None]
    if not batches:
        return None
    new, cached = int(batches[-1].group(1)), int(batches[-1].group(2))
    return cached / (new + cached) if new + cached else 0.0


class CacheMetricsWindow:
    """Upstream's cache series of ``sharded`` and ``reference`` over the requests a scenario
    sends between :meth:`open` and :meth:`close` (both servers serving the same ones)."""

    def __init__(self, rec: Recorder, sharded: Server, reference: Server, relations: Sequence[Relation]):
        self.rec, self.sharded, self.reference, self.relations = rec, sharded, reference, tuple(relations)
        self._before: List[Metrics] = []
        self._marks: List[int] = []

    def open(self, flush_first: bool) -> "CacheMetricsWindow":
        """Read both servers once still; ``flush_first``: empty both servers' device and host
        tiers first, so that their trees start alike whatever ran before."""
        servers = (self.sharded, self.reference)
        if flush_first:
            _still(servers, self.relations)  # no backup in flight: a flush waits for none
            for server in servers:
                self.rec.expect(flush(server), f"/flush_cache failed on {server.name}")
            self._before = [server.metrics() for server in servers]  # a flush moves no counter
        else:
            self._before = _still(servers, self.relations)
        self._marks = [server.log_lines() for server in servers]
        return self

    def close(self, host_gauges: bool = False) -> Tuple[Metrics, Metrics]:
        """Compare; the sharded server's (after, before) readings."""
        rec = self.rec
        after = _still((self.sharded, self.reference), self.relations)
        problems, figures = compare(self.relations, (after[0], self._before[0]), (after[1], self._before[1]), rec.session.tp)
        for problem in problems:
            rec.expect(False, problem)
        rec.note("upstream cache series, delta: " + "; ".join(figures))
        self._hit_rate(after)
        if host_gauges:
            self._host_gauges()
        return after[0], self._before[0]

    def _hit_rate(self, after: List[Metrics]) -> None:
        name = "sglang:cache_hit_rate"
        rates = []
        for server, metrics, mark in zip((self.sharded, self.reference), after, self._marks):
            gauge = metrics.per_rank(name).get(0)  # the stats-logging rank's (CP rank 0)
            logged = last_batch_hit_rate(server, mark)
            ok = gauge is not None and logged is not None and abs(gauge - logged) < 1e-9
            self.rec.expect(ok, f"{name} on {server.name}: {gauge} != its last logged prefill batch's {logged}")
            rates.append(gauge)
        self.rec.expect(rates[0] == rates[1], f"{name}: sharded {rates[0]} != reference {rates[1]}")
        self.rec.note(f"{name}: sharded {rates[0]:.6g}, reference {rates[1]:.6g} (= each one's last logged batch)")

    def _host_gauges(self) -> None:
        """Host used / total tokens after a sub-page probe on both (its prefill batch
        republishes the gauges; it backs up nothing): used logical; total = every owner
        lane's allocatable pages, where upstream's also counts its reserved page 0."""
        self.rec.pair("metrics probe (under one page)", tokens("metrics:probe", PAGE_SIZE // 2))
        # answered: its prefill batch's report (before its forward) published the gauges
        sharded, reference = self.sharded.metrics(), self.reference.metrics()
        used, total = "sglang:hicache_host_used_tokens", "sglang:hicache_host_total_tokens"
        ours = {n: sharded.per_rank(n).get(0) for n in (used, total)}
        theirs = {n: reference.per_rank(n).get(0) for n in (used, total)}
        self.rec.expect(ours[used] is not None and ours[used] == theirs[used], f"{used}: sharded {ours[used]} != reference {theirs[used]}")
        self.rec.expect(
            ours[total] is not None and theirs[total] is not None and ours[total] == theirs[total] - PAGE_SIZE,
            f"{total}: sharded {ours[total]} != reference {theirs[total]} less its reserved page",
        )
        self.rec.note(f"host tokens used/total: sharded {ours[used]:g}/{ours[total]:g}, reference {theirs[used]:g}/{theirs[total]:g}")


def storage_hit_on_both(rec: Recorder, sharded: Server, prompt: List[int], label: str) -> None:
    """``prompt`` extended once more after BOTH servers' device and host tiers are flushed:
    an L3 hit on each (its own tier), upstream's storage series compared."""
    window = CacheMetricsWindow(rec, sharded, rec.session.reference, STORAGE_SERIES).open(flush_first=True)
    a, b = rec.pair("both flushed: storage hit on each", prompt + tokens(f"{label}:metrics", 25))
    want = full_pages(len(prompt))
    for side, completion in (("sharded", a), ("reference", b)):
        if completion is not None:
            rec.expect(completion.tier("storage") >= want, f"{side} storage hit {completion.cached_by_tier}, want {want}")
    pages = PREFETCH_PAGES.delta(*window.close())
    if pages:  # a backend with stats: the CP ranks together read each hit page once
        rec.expect(sum(pages.values()) == want // PAGE_SIZE, f"{PREFETCH_PAGES.name}: CP ranks read {pages} pages, the hit is {want // PAGE_SIZE}")
        rec.note(f"{PREFETCH_PAGES.name} per CP rank {pages} for a {want // PAGE_SIZE}-page hit")


__all__ = ["CacheMetricsWindow", "L2_SERIES", "Relation", "STORAGE_SERIES", "compare", "last_batch_hit_rate", "storage_hit_on_both"]
