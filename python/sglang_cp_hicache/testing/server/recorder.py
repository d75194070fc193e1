"""What every serving scenario shares: prompts from labels, the :class:`Recorder` that sends
each request to the sharded prefill's router and its reference's and compares the answers
(output ids equal, logprobs bit for bit), the :class:`ScenarioReport` it fills, and the
small probes of a server's state (``/flush_cache``, its request queues, an L3 folder).
"""

from __future__ import annotations

import logging
import random
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.testing.server.client import TIERS, Completion, RequestFailed, generate, post
from sglang_cp_hicache.testing.server.cluster import Router, Server
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession

logger = logging.getLogger(__name__)

MAX_NEW = 4
FIRST_TOKEN_ID = 3  # ids 0-2 are the tiny tokenizer's special tokens
VOCAB_SIZE = 512
L3_SETTLE_S = 60.0


def tokens(label: str, count: int) -> List[int]:
    """``count`` token ids from ``label`` (stable across processes and runs)."""
    rng = random.Random(f"serving:{label}")
    return [rng.randrange(FIRST_TOKEN_ID, VOCAB_SIZE) for _ in range(count)]


@dataclass
class ScenarioReport:
    """What one scenario showed; ``ok`` when nothing differed and every expectation held."""

    name: str
    requests: int = 0
    mismatches: List[str] = field(default_factory=list)
    max_logprob_diff: float = 0.0
    cached: Dict[str, Dict[str, int]] = field(default_factory=dict)
    ttft_ratio: Dict[str, float] = field(default_factory=dict)  # tier -> cached / cold
    sent_mb_per_rank: Dict[int, float] = field(default_factory=dict)
    wall_s: float = 0.0
    problems: List[str] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)
    decode_logprob_diff_vs_tp1: float = 0.0  # lines with a decode reference only

    @property
    def identical(self) -> bool:
        return not self.mismatches

    @property
    def ok(self) -> bool:
        return self.identical and not self.problems

    def as_dict(self) -> dict:
        return {**self.__dict__, "identical": self.identical, "ok": self.ok}


class Recorder:
    """One scenario's bookkeeping: requests sent to a sharded and a reference router and
    compared, expectations, the sharded prefill's PD bytes per rank, TTFT by tier."""

    def __init__(
        self,
        session: ServingSession,
        name: str,
        sharded: Optional[Router] = None,
        reference: Optional[Router] = None,
    ):
        self.session = session
        self.sharded = sharded or session.sharded_router
        self.reference = reference or session.reference_router
        self.report = ScenarioReport(name, cached={SHARDED: dict.fromkeys(TIERS, 0), REFERENCE: dict.fromkeys(TIERS, 0)})
        self._started = time.monotonic()
        self._sent_before = self._sent()
        self._cold: List[float] = []
        self._by_tier: Dict[str, List[float]] = defaultdict(list)

    def _sent(self) -> Dict[int, float]:
        return self.sharded.prefill.metrics().per_rank("sglang:kv_transfer_total_mb_sum")

    def ask(self, router: Router, label: str, ids: Sequence[int], max_new: int = MAX_NEW, **extra) -> Optional[Completion]:
        """One request to one router (no comparison); None and a problem when it fails."""
        self.report.requests += 1
        try:
            return generate(router.url, ids, max_new, extra=extra or None)
        except RequestFailed as error:
            self.expect(False, f"{label} via {router.name}: {error}")
            return None

    def pair(self, label: str, ids: Sequence[int], max_new: int = MAX_NEW, cold: bool = False) -> Tuple[Optional[Completion], Optional[Completion]]:
        """``ids`` through the sharded and the reference router, compared (on a line with a
        decode reference: the first token with the reference, the rest with it)."""
        a = self.ask(self.sharded, label, ids, max_new)
        b = self.ask(self.reference, label, ids, max_new)
        decode_router = self.session.decode_reference_router
        c = self.ask(decode_router, label, ids, max_new) if decode_router is not None else None
        if a is not None and b is not None:
            if decode_router is None:
                self.compare(label, a, b)
            else:
                self.compare(f"{label} (first token)", _first(a), _first(b))
                if c is not None:
                    self.compare_decode(label, a, c)
            for side, completion in ((SHARDED, a), (REFERENCE, b)):
                for tier in TIERS:
                    self.report.cached[side][tier] += completion.tier(tier)
            self.time(a, cold)
        return a, b

    def compare(self, label: str, a: Completion, b: Completion) -> None:
        if a.output_ids != b.output_ids:
            self.report.mismatches.append(f"{label}: output ids {list(a.output_ids)} != reference {list(b.output_ids)}")
        if len(a.logprobs) != len(b.logprobs):
            self.report.mismatches.append(f"{label}: {len(a.logprobs)} logprobs != reference {len(b.logprobs)}")
            return
        diff = max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)
        self.report.max_logprob_diff = max(self.report.max_logprob_diff, diff)
        if diff != 0.0:
            self.report.mismatches.append(f"{label}: logprobs differ by up to {diff:.3g}")

    def compare_decode(self, label: str, a: Completion, c: Completion) -> None:
        """The decode tokens against a one-rank reference: ids equal; the logprobs carry a
        TP 1 vs TP 2 KV difference, reported, not a mismatch."""
        if a.output_ids[1:] != c.output_ids[1:]:
            self.report.mismatches.append(f"{label}: decode ids {list(a.output_ids[1:])} != TP 1 reference {list(c.output_ids[1:])}")
        diff = max((abs(x - y) for x, y in zip(a.logprobs[1:], c.logprobs[1:])), default=0.0)
        self.report.decode_logprob_diff_vs_tp1 = max(self.report.decode_logprob_diff_vs_tp1, diff)

    def time(self, completion: Completion, cold: bool) -> None:
        if cold:
            self._cold.append(completion.ttft_s)
            return
        tier = max(TIERS, key=completion.tier)
        if completion.tier(tier) > 0:
            self._by_tier[tier].append(completion.ttft_s)

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.report.problems.append(problem)
        return ok

    def note(self, text: str) -> None:
        self.report.notes.append(text)

    def finish(self) -> ScenarioReport:
        if self.session.decode_reference_router is not None and self.report.decode_logprob_diff_vs_tp1 > 0:
            self.note(
                "decode tokens vs the TP 1 reference: ids equal, logprobs differ by up to "
                f"{self.report.decode_logprob_diff_vs_tp1:.3g} (TP 1 vs TP 2 KV bits)"
            )
        after = self._sent()
        self.report.sent_mb_per_rank = {r: round(after.get(r, 0.0) - self._sent_before.get(r, 0.0), 3) for r in after}
        if self._cold:
            cold = sum(self._cold) / len(self._cold)
            self.report.ttft_ratio = {
                tier: round(sum(ts) / len(ts) / cold, 3) for tier, ts in self._by_tier.items() if cold > 0
            }
        self.report.wall_s = round(time.monotonic() - self._started, 1)
        return self.report


# ------------------------------------------------------------------------ helpers
def _first(completion: Completion) -> Completion:
    """``completion`` cut to its first token (the one the prefill computes)."""
    return replace(completion, output_ids=completion.output_ids[:1], logprobs=completion.logprobs[:1])


def wait_settled(count: Callable[[], int], at_least: int, timeout_s: float = L3_SETTLE_S) -> int:
    """Poll ``count`` until it is at least ``at_least`` and unchanged for 2 s; its value."""
    deadline = time.monotonic() + timeout_s
    last, stable_since = -1, time.monotonic()
    while time.monotonic() < deadline:
        value = count()
        if value != last:
            last, stable_since = value, time.monotonic()
        elif value >= at_least and time.monotonic() - stable_since >= 2.0:
            return value
        time.sleep(0.25)
    return last


def files_under(folder: Path) -> int:
    return sum(1 for path in folder.rglob("*") if path.is_file()) if folder.exists() else 0


def flush(server: Server) -> bool:
    """``/flush_cache``: drop the device and host tiers (the L3 tier stays)."""
    status, _ = post(server.url, "/flush_cache", b"{}")
    return status == 200


def full_pages(count: int) -> int:
    return count // PAGE_SIZE * PAGE_SIZE


def in_flight(server: Server) -> bool:
    metrics = server.metrics()
    return any(
        metrics.total(name) > 0
        for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_bootstrap_queue_reqs", "sglang:num_prefill_inflight_queue_reqs")
    )


def taken(server: Server) -> bool:
    """``server`` (a prefill) holds a request past its bootstrap: the decode's metadata came,
    so a dead decode fails its transfer at once (a request still bootstrapping waits out
    ``cluster.PD_BOOTSTRAP_TIMEOUT_S``)."""
    metrics = server.metrics()
    names = ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:num_prefill_inflight_queue_reqs")
    return metrics.total("sglang:num_prefill_bootstrap_queue_reqs") == 0 and any(metrics.total(n) > 0 for n in names)


def phase(server: Server) -> str:
    metrics = server.metrics()
    names = ("num_prefill_bootstrap_queue_reqs", "num_queue_reqs", "num_running_reqs", "num_prefill_inflight_queue_reqs")
    return ", ".join(f"{n.replace('num_', '').replace('_reqs', '')} {metrics.total('sglang:' + n):.0f}" for n in names)



__all__ = [
    "FIRST_TOKEN_ID",
    "L3_SETTLE_S",
    "MAX_NEW",
    "Recorder",
    "ScenarioReport",
    "VOCAB_SIZE",
    "files_under",
    "flush",
    "full_pages",
    "in_flight",
    "phase",
    "taken",
    "tokens",
    "wait_settled",
]
