"""The soak's traffic (``soak.py``): concurrent multi-turn conversations through the
routers, each turn the earlier turns (prompts and answers) plus new tokens, mixed with
what clients do wrong: malformed and over-length bodies, disconnects mid-prefill and
mid-stream. Every request is classified by what came back and how long it took.

Workers pause at a gate while the fault injector replaces the decode and the routers
(``soak_faults.py``); the router of a conversation is looked up per request.
"""

from __future__ import annotations

import http.client
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Tuple

from sglang_cp_hicache.testing.server.client import RequestFailed, generate, post
from sglang_cp_hicache.testing.server.cluster import Router
from sglang_cp_hicache.testing.server.launch import CONTEXT_LENGTH, PAGE_SIZE, ROUTER_REQUEST_TIMEOUT_S
from sglang_cp_hicache.testing.server.recorder import tokens

#: A request must be answered (tokens or an HTTP error) within this; past it, it hung.
ANSWER_BOUND_S = ROUTER_REQUEST_TIMEOUT_S + 30.0
MAX_NEW = 8
SYSTEM_PROMPTS = 3  # conversations share one of these first pages (prefix reuse)
#: What a worker does besides a conversation turn, and how often (of 100 draws).
MIX = (("malformed", 3), ("over_length", 2), ("disconnect_prefill", 2), ("disconnect_stream", 2))


@dataclass
class Tally:
    """Every outcome of the soak, by kind (thread-safe); the longest answer time."""

    counts: Counter = field(default_factory=Counter)
    failures: List[str] = field(default_factory=list)
    longest_s: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, kind: str, took_s: float = 0.0, detail: str = "") -> None:
        with self._lock:
            self.counts[kind] += 1
            self.longest_s = max(self.longest_s, took_s)
            if detail:
                self.failures.append(f"{kind}: {detail[:200]}")

    def as_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "longest_s": round(self.longest_s, 1), "failures": self.failures[-50:]}


@dataclass
class Conversation:
    """One multi-turn session: its history grows by each prompt and answer."""

    key: int
    target: str  # which router
    rng: random.Random
    history: List[int] = field(default_factory=list)
    turns: int = 0
    restarts: int = 0

    def next_prompt(self) -> List[int]:
        new = tokens(f"soak:{self.key}:{self.restarts}:{self.turns}", self.rng.randrange(20, 150))
        if not self.history or len(self.history) + len(new) + MAX_NEW >= CONTEXT_LENGTH:
            self.restarts += 1
            self.turns = 0
            system = tokens(f"soak:system:{self.rng.randrange(SYSTEM_PROMPTS)}", 2 * PAGE_SIZE)
            self.history = system
        return self.history + new

    def answered(self, prompt: List[int], output_ids: Tuple[int, ...]) -> None:
        self.history = prompt + list(output_ids)
        self.turns += 1


def classify(error: RequestFailed, took_s: float) -> str:
    """The kind of a failed request: ``hung`` past the bound, ``no_answer`` (no HTTP
    status: a connection refused or reset), else ``http_<status>``."""
    if took_s >= ANSWER_BOUND_S - 1.0 or "timed out" in str(error):
        return "hung"
    return f"http_{error.status}" if error.status else "no_answer"


class Gate:
    """Workers pass while it is open; :meth:`closed` shuts it and waits (bounded) for the
    requests in flight to be answered."""

    def __init__(self) -> None:
        self._open = threading.Event()
        self._open.set()
        self._in_flight = 0
        self._idle = threading.Condition()

    def enter(self, stop: threading.Event) -> bool:
        while not self._open.wait(0.5):
            if stop.is_set():
                return False
        with self._idle:
            self._in_flight += 1
        return True

    def leave(self) -> None:
        with self._idle:
            self._in_flight -= 1
            self._idle.notify_all()

    def close(self, drain_s: float = ANSWER_BOUND_S) -> int:
        """Shut the gate; the number of requests still in flight after ``drain_s``."""
        self._open.clear()
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=drain_s)
            return self._in_flight

    def open(self) -> None:
        self._open.set()


@dataclass
class Traffic:
    """``concurrency`` workers over ``conversations``, through ``routes()`` (name -> router,
    read per request); :meth:`run` until ``stop`` is set."""

    routes: Callable[[], Dict[str, Router]]
    conversations: List[Conversation]
    seed: int
    concurrency: int = 8
    tally: Tally = field(default_factory=Tally)
    gate: Gate = field(default_factory=Gate)
    stop: threading.Event = field(default_factory=threading.Event)
    #: Set from a decode's SIGKILL until its replacement serves: a stream it cuts (HTTP
    #: 200 sent, then no finish) is counted apart, as that fault's.
    decode_down: threading.Event = field(default_factory=threading.Event)

    def start(self) -> List[threading.Thread]:
        workers = [threading.Thread(target=self._work, args=(i,), daemon=True, name=f"soak-{i}") for i in range(self.concurrency)]
        for worker in workers:
            worker.start()
        return workers

    def _work(self, index: int) -> None:
        rng = random.Random(f"{self.seed}:worker:{index}")
        free = list(self.conversations[index :: self.concurrency])
        while not self.stop.is_set():
            if not self.gate.enter(self.stop):
                return
            try:
                self._one(rng, free)
            finally:
                self.gate.leave()

    def _one(self, rng: random.Random, mine: List[Conversation]) -> None:
        draw = rng.randrange(100)
        for kind, share in MIX:
            if draw < share:
                return self._misbehave(kind, rng)
            draw -= share
        self.turn(rng.choice(mine))

    def turn(self, conversation: Conversation) -> None:
        router = self.routes()[conversation.target]
        prompt = conversation.next_prompt()
        started = time.monotonic()
        try:
            completion = generate(router.url, prompt, MAX_NEW, timeout_s=ANSWER_BOUND_S, extra={"return_logprob": False})
        except RequestFailed as error:
            took = time.monotonic() - started
            during = "decode_kill_" if self.decode_down.is_set() else ""
            self.tally.add(f"turn_{conversation.target}_{during}{classify(error, took)}", took, str(error))
            return
        conversation.answered(prompt, completion.output_ids)
        self.tally.add(f"turn_{conversation.target}_ok", time.monotonic() - started)

    def _misbehave(self, kind: str, rng: random.Random) -> None:
        router = self.routes()[rng.choice(sorted(self.routes()))]
        started = time.monotonic()
        if kind == "malformed":
            body = rng.choice([b"{", json.dumps({"input_ids": "abc"}).encode(), json.dumps({"input_ids": [[[1]]]}).encode()])
            status, text = post(router.url, "/generate", body, timeout_s=ANSWER_BOUND_S)
        elif kind == "over_length":
            body = {"input_ids": tokens("soak:over", CONTEXT_LENGTH + 50), "sampling_params": {"max_new_tokens": 4}}
            status, text = post(router.url, "/generate", json.dumps(body).encode(), timeout_s=ANSWER_BOUND_S)
        else:
            status, text = disconnect(router, mid_stream=kind == "disconnect_stream", label=f"{self.seed}:{rng.random()}")
        outcome = "as_expected" if _expected(kind, status) else f"unexpected_{status}"
        self.tally.add(f"{kind}_{outcome}", time.monotonic() - started, "" if outcome == "as_expected" else text)


def _expected(kind: str, status: int) -> bool:
    if kind.startswith("disconnect"):
        return status == -1  # the client went away as planned
    return 400 <= status < 500


def disconnect(router: Router, mid_stream: bool, label: str) -> Tuple[int, str]:
    """A streamed request its client abandons: before the first chunk (mid-prefill, a
    three-chunk prompt) or after two chunks (mid-stream); (-1, "") when it went as
    planned, else the status and text that came instead."""
    prompt = tokens(f"soak:gone:{label}", 200 if mid_stream else 3 * 512 + 7)
    body = {"input_ids": prompt, "stream": True, "sampling_params": {"max_new_tokens": 64, "ignore_eos": True, "temperature": 0}}
    connection = http.client.HTTPConnection(router.endpoint.url.split("//")[1], timeout=ANSWER_BOUND_S)
    try:
        connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        if not mid_stream:
            time.sleep(0.3)  # the router has sent it on; the prefill is computing
            return -1, ""
        response = connection.getresponse()
        if response.status != 200:
            return response.status, response.read().decode(errors="replace")
        chunks = 0
        while chunks < 2:
            line = response.fp.readline()
            if not line:
                return 0, "stream ended before two chunks"
            chunks += line.startswith(b"data:")
        return -1, ""
    except (OSError, http.client.HTTPException) as error:
        return 0, repr(error)
    finally:
        connection.close()  # the disconnect


def conversations(seed: int, targets: Dict[str, int]) -> List[Conversation]:
    """``targets[name]`` conversations per router, each with its own seeded draws."""
    made: List[Conversation] = []
    for name, count in sorted(targets.items()):
        for _ in range(count):
            made.append(Conversation(len(made), name, random.Random(f"{seed}:conversation:{len(made)}")))
    random.Random(seed).shuffle(made)
    return made


__all__ = ["ANSWER_BOUND_S", "Conversation", "Gate", "Tally", "Traffic", "classify", "conversations", "disconnect"]
