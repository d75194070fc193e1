"""What every line's rank driver shares: timing of scheduler-path calls, the decision log,
violations, the drain schedule and the rank process set-up.

A line's driver (``sim/<line>/driver.py``) owns the SGLang calls; this module imports no
SGLang, so the parent process and both lines can use it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import sys
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterator, List, Optional, Sequence

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import OPS, RankResult, SeriesPoint
from sglang_cp_hicache.sim.workload import Request
from sglang_cp_hicache.testing.dist import heartbeat

if TYPE_CHECKING:  # torch loads only in the rank processes
    from sglang_cp_hicache.sim.collectives import CollectiveCounter

MAX_VIOLATIONS = 50
MAX_DRAIN_STEPS = 10_000  # steps after the trace for deferred, re-queued and chunked work


class SimulationError(RuntimeError):
    """The replay cannot continue (e.g. the scheduler would be out of memory)."""


@dataclass(frozen=True)
class TreeSummary:
    """A radix tree's rank-independent digest and token counts (logical state only)."""

    digest: str
    nodes: int
    device_tokens: int  # tokens with a device value (evictable + protected)
    host_tokens: int  # logical tokens with a host value


class OpTimer:
    """Times cache calls on the scheduler path, per operation and step, and counts the
    collectives they issue.

    Scheduler-thread CPU time is the figure of merit (N ranks share few cores, so wall
    time mostly measures who got the core); wall time is kept too. A timed call nested in
    another (``evict`` inside ``alloc``) owns its time: the caller keeps only the rest.
    """

    def __init__(self, counter: CollectiveCounter) -> None:
        self.counter = counter
        self.samples: Dict[str, List[float]] = {op: [] for op in OPS}
        self.wall_samples: Dict[str, List[float]] = {op: [] for op in OPS}
        self._pending: Dict[str, float] = defaultdict(float)
        self._pending_wall: Dict[str, float] = defaultdict(float)
        self._open: List[List[int]] = []  # [cpu ns, wall ns] spent in nested timed ops

    @contextlib.contextmanager
    def op(self, name: Optional[str]) -> Iterator[None]:
        """One cache call: collectives counted; its time added to ``name`` (None: not
        timed, e.g. lock calls, but still counted)."""
        with self.counter.counting():
            nested = [0, 0]
            self._open.append(nested)
            start_cpu, start_wall = time.thread_time_ns(), time.perf_counter_ns()
            try:
                yield
            finally:
                cpu = time.thread_time_ns() - start_cpu
                wall = time.perf_counter_ns() - start_wall
                self._open.pop()
                if name is not None:
                    self._pending[name] += (cpu - nested[0]) / 1000.0
                    self._pending_wall[name] += (wall - nested[1]) / 1000.0
                    nested = [cpu, wall]
                if self._open:
                    self._open[-1][0] += nested[0]
                    self._open[-1][1] += nested[1]

    @contextlib.contextmanager
    def untimed(self) -> Iterator[None]:
        """The simulator's own bookkeeping inside a timed call (its checkers' records): its
        time is taken out of the enclosing operation and counted in none."""
        start_cpu, start_wall = time.thread_time_ns(), time.perf_counter_ns()
        try:
            yield
        finally:
            if self._open:
                self._open[-1][0] += time.thread_time_ns() - start_cpu
                self._open[-1][1] += time.perf_counter_ns() - start_wall

    def end_step(self) -> None:
        """One sample per operation that ran in this step."""
        for name, micros in self._pending.items():
            self.samples[name].append(micros)
            self.wall_samples[name].append(self._pending_wall[name])
        self._pending.clear()
        self._pending_wall.clear()


@dataclass
class DecisionLog:
    """A running hash of the replicated decisions; equal on every rank or the run stops."""

    digest: bytes = field(
        default_factory=lambda: hashlib.blake2b(b"cp-hicache-sim", digest_size=8).digest()
    )

    def fold(self, records: List[tuple]) -> None:
        self.digest = hashlib.blake2b(self.digest + repr(records).encode(), digest_size=8).digest()

    def as_int(self) -> int:
        return int.from_bytes(self.digest, "little", signed=True)

    def hex(self) -> str:
        return self.digest.hex()


@dataclass
class Violations:
    """A rank's invariant violations, each naming the rank and step (bounded)."""

    rank: int
    step: int = 0
    messages: List[str] = field(default_factory=list)

    def __call__(self, message: str) -> None:
        if len(self.messages) < MAX_VIOLATIONS:
            self.messages.append(f"rank {self.rank} step {self.step}: {message}")


def drain_schedule(
    steps: Sequence[Sequence[Request]],
    waiting: Callable[[], List[str]],
    violation: Callable[[str], None],
) -> Iterator[Sequence[Request]]:
    """The trace's steps, then empty steps while ``waiting()`` names requests (deferred,
    re-queued or mid-chunk; replicated, so every rank drains alike)."""
    yield from steps
    for _ in range(MAX_DRAIN_STEPS):
        if not waiting():
            return
        yield []
    violation(f"requests {waiting()} still waiting after the drain steps")


def setup_rank_process(cfg: SimConfig, label: str) -> None:
    """Logging with the rank's label; one intra-op thread (N ranks share the cores)."""
    import torch

    logging.basicConfig(
        level=cfg.log_level.upper(),
        stream=sys.stderr,
        format=f"%(asctime)s [{label}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )
    torch.set_num_threads(1)


def max_context_len(steps: Sequence[Sequence[Request]], page_size: int) -> int:
    """Room for the longest prompt plus a spare page, page-aligned."""
    longest = max(len(r.token_ids) for step in steps for r in step)
    return (longest // page_size + 2) * page_size


def run_with_progress(run: Callable[[Any], Any], enabled: bool, total: int, desc: str) -> Any:
    """``run(bar)`` with a tqdm bar on stderr when ``enabled`` (else ``run(None)``)."""
    if not enabled:
        return run(None)
    from tqdm import tqdm

    bar = tqdm(total=total, desc=desc, unit="batch", file=sys.stderr, leave=False)
    try:
        return run(bar)
    finally:
        bar.close()


@dataclass
class FaultHooks:
    """Points inside the driver where a planted fault acts (off by default)."""

    extra_eviction_at_step: Optional[int] = None


def plant_match_prefix_barrier(cache: Any, cp_group: Any) -> None:
    """The ``hot_path_barrier`` fault: a CP barrier before every ``match_prefix``."""
    import torch.distributed as dist

    match_prefix = cache.match_prefix

    def match_prefix_with_barrier(params):
        dist.barrier(group=cp_group)
        return match_prefix(params)

    cache.match_prefix = match_prefix_with_barrier


@dataclass(eq=False)
class TraceAttempt:
    """One attempt of a trace request (a retraction re-queues the next one): what a line's
    request record shares; ``started`` once its first chunk ran (its hit counted and checked)."""

    request: Request
    attempt: int = 0
    started: bool = False

    @property
    def rid(self) -> str:
        return f"{self.request.index}:{self.attempt}"

    @property
    def prompt(self) -> Sequence[int]:
        return self.request.token_ids


class StepLoop:
    """The replay loop and bookkeeping both lines' ``RankDriver`` share.

    The driver sets ``step_index``, ``_violation`` (:class:`Violations`), ``decisions``
    (:class:`DecisionLog`), ``agree``, ``hooks`` (:class:`FaultHooks`), ``timer``, ``_op``,
    ``counter``, ``counters``, ``series``, ``ledger``, ``lane_usage``, ``observer``,
    ``bytes_per_token``, ``host_peak_physical``/``host_peak_logical`` and ``_in_flight``
    (``(step, event hold)`` of the writes in flight), and defines the line's calls:
    ``_step(requests)``, ``_waiting_rids()``, ``_extra_eviction()``, ``_tree_summary()``,
    ``_check_tree()`` (a summary, checked) and ``_finish_run(stopped)``.
    """

    def _replay(
        self, steps: Sequence[Sequence[Request]], progress: Any, new_req: Callable[[Request], Any]
    ) -> Any:
        """Every step of the trace and the drain, then the final checks (``_finish_run``)."""
        stopped: Optional[str] = None
        schedule = drain_schedule(steps, self._waiting_rids, self._violation)
        for step_index, requests in enumerate(schedule):
            self.step_index = self._violation.step = step_index
            try:
                records = self._step([new_req(r) for r in requests])
            except SimulationError as exc:
                # Replicated decisions: every rank stops at this same step.
                stopped = str(exc)
                self._violation(stopped)
                break
            self.decisions.fold(records)
            if self.hooks.extra_eviction_at_step == self.step_index:
                self._extra_eviction()
                self.decisions.fold([("fault_extra_eviction",)])
            if not self.agree(self.decisions.as_int()):
                # Stop before the next step: diverged ranks could disagree on their
                # all-reduces (writing_check's, the ready acks') and hang.
                stopped = f"decision logs diverged across ranks at step {self.step_index}"
                self._violation(stopped)
                break
            if progress is not None and self.step_index < len(steps):
                progress.update(1)
            heartbeat()  # the launch's timeout counts from the last step, not the start
        self.step_index = self._violation.step = self.step_index + 1
        self._land_writes(keep=0)  # every transfer lands before the final checks
        return self._finish_run(stopped)

    def _land_writes(self, keep: int) -> None:
        """Complete the write transfers submitted ``keep`` or more steps ago."""
        while self._in_flight and self._in_flight[0][0] <= self.step_index - keep:
            self._in_flight.pop(0)[1].release()

    def _sample_host_usage(self) -> None:
        """One series point and the host peaks (bytes) after a step; per-lane usage when
        sharded."""
        physical = self.ledger.host_used_physical_tokens() * self.bytes_per_token
        logical = self.ledger.host_used_logical_tokens() * self.bytes_per_token
        self.host_peak_physical = max(self.host_peak_physical, physical)
        self.host_peak_logical = max(self.host_peak_logical, logical)
        c = self.counters
        hits = c.device_hit_tokens + c.host_hit_tokens
        self.series.append(SeriesPoint(c.requests, c.prompt_tokens, hits, physical, logical))
        if self.lane_usage is not None:
            self.lane_usage.sample(self.ledger.device_lane_used(), self.ledger.host_lane_used())

    def _final_checks(self, stopped: Optional[str]) -> tuple:
        """The last events, idle and tree checks and the flush: ``(summary, (leaked device,
        host, req slots))``. After an early stop only the summary (no flush: locks of the
        interrupted batch are held, and diverged ranks could disagree on whether they
        all-reduce, a hang)."""
        if stopped is not None:
            return self._tree_summary(), (0, 0, 0)
        with self._op(None):
            self.cache.check_hicache_events()
        self.ledger.check_idle()
        summary = self._check_tree()
        return summary, self.ledger.flush(lambda: self._op(None))

    def _rank_result(
        self, stopped: Optional[str], summary: TreeSummary, leaks: tuple, shared_kv: bool, **extra: Any
    ) -> RankResult:
        """The rank's :class:`RankResult` (``extra``: the line's own fields)."""
        leaked_device, leaked_host, leaked_req = leaks
        return RankResult(
            rank=self.rank,
            shared_kv=shared_kv,
            counters=self.counters,
            op_samples_us=self.timer.samples,
            op_wall_samples_us=self.timer.wall_samples,
            decision_hash=self.decisions.hex(),
            tree_digest=summary.digest,
            tree_nodes=summary.nodes,
            violations=self._violation.messages,
            hot_path_collectives=dict(self.counter.hot_path),
            allowed_collectives=self.counter.allowed,
            bytes_per_token=self.bytes_per_token,
            d2h_bytes=self.observer.d2h_tokens * self.bytes_per_token,
            h2d_bytes=self.observer.h2d_tokens * self.bytes_per_token,
            host_peak_physical_bytes=self.host_peak_physical,
            host_peak_logical_bytes=self.host_peak_logical,
            leaked_device_slots=leaked_device,
            leaked_host_slots=leaked_host,
            leaked_req_slots=leaked_req,
            steps_run=self.step_index,
            series=self.series,
            lane_usage=self.lane_usage,
            stopped_early=stopped,
            **extra,
        )
