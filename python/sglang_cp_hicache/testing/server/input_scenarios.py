"""Scenarios of what a user sends wrong or at an awkward moment (issue 42): bad ``/generate``
bodies through the router and straight to the sharded prefill, a 300-prompt batch, and a
request right after a warm-up and a ``/flush_cache``.

A bad body gets a 4xx naming its problem, or is served correctly (checked), and the
servers serve the next request. Bodies that kill upstream's scheduler (the flag refuses
them: ``v0_5_23/admission``) are never sent to the unsharded reference, which runs
upstream's validation; what the reference answers to the others is noted beside.

What the plugin refuses and upstream admits is refused by the flag's prefill and by the PD
decode (the plugin's rule: sglang-router answers with the decode's response), so through
the router it gets the 400 at once, well within :data:`REFUSAL_S`, not after the decode's
PD wait. Those bodies are not sent through the reference router: its prefill, upstream's,
would admit them and wait out its PD bootstrap for the decode that refused them.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

from sglang_cp_hicache.testing.server.client import RequestFailed, check_finished, generate, post
from sglang_cp_hicache.testing.server.cluster import PD_BOOTSTRAP_TIMEOUT_S, PD_WAITING_TIMEOUT_S, Router, Server
from sglang_cp_hicache.testing.server.jit_prebuild import NATIVE_HASH
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE
from sglang_cp_hicache.testing.server.recorder import MAX_NEW, VOCAB_SIZE, Recorder, ScenarioReport, flush, tokens
from sglang_cp_hicache.testing.server.session import WARM_UP_IDS, ServingSession

PROMPT = tokens("bad-input", 70)
GREEDY = {"temperature": 0, "max_new_tokens": MAX_NEW, "ignore_eos": True}
BATCH_PROMPTS = 300
BATCH_TIMEOUT_S = 300.0  # the router's own bound is 180 s: a 500 must come from a server
REQUEST_S = 60.0
#: A refusal's bound through the router: a validation error on a busy box, far below the
#: decode's PD wait (``PD_WAITING_TIMEOUT_S``), which a refused request must not wait out.
REFUSAL_S = PD_WAITING_TIMEOUT_S / 4
Check = Callable[[object], Optional[str]]  # a served answer's problem, or None


@dataclass(frozen=True)
class BadInput:
    """One ``/generate`` body: ``refused`` names the words a 4xx must carry (any one of
    them), else it must be served and pass ``check``; ``kills_upstream``: upstream's
    scheduler dies on it; ``plugin_refusal``: the plugin refuses it (the flag's prefill and
    the PD decode), upstream admits it. Neither kind goes to the reference router."""

    name: str
    body: dict
    refused: Tuple[str, ...] = ()
    check: Optional[Check] = None
    kills_upstream: bool = False
    plugin_refusal: bool = False


def _body(**fields) -> dict:
    return {"input_ids": PROMPT, "sampling_params": GREEDY, **fields}


def _sampling(**params) -> dict:
    return _body(sampling_params={**GREEDY, **params})


def _answers(count: int, tokens_each: int) -> Check:
    def check(answer: object) -> Optional[str]:
        answers = answer if isinstance(answer, list) else [answer]
        if len(answers) != count:
            return f"{len(answers)} answers, want {count}"
        lengths = [len(a.get("output_ids") or ()) for a in answers]
        return None if all(n == tokens_each for n in lengths) else f"output lengths {sorted(set(lengths))}, want {tokens_each}"

    return check


def _logprobs(field: str, rows: int, width: Optional[int] = None) -> Check:
    """``meta_info[field]`` has ``rows`` entries (each a list of ``width`` when given)."""

    def check(answer: object) -> Optional[str]:
        got = (answer.get("meta_info") or {}).get(field) or []
        if len(got) != rows:
            return f"{field}: {len(got)} entries, want {rows}"
        if width is not None and any(len(row or ()) != width for row in got):
            return f"{field}: rows of {sorted({len(row or ()) for row in got})}, want {width}"
        return None

    return check


CASES: Tuple[BadInput, ...] = (
    BadInput("empty input_ids", _body(input_ids=[]), ("empty",)),
    BadInput("negative token id", _body(input_ids=[5, -1, 7]), ("outside the vocabulary",), plugin_refusal=True),
    BadInput("token id = vocab size", _body(input_ids=[5, VOCAB_SIZE, 7]), ("outside the vocabulary",), plugin_refusal=True),
    BadInput("token id 10**12", _body(input_ids=[5, 10**12, 7]), ("input_ids", "outside the vocabulary")),
    BadInput("float input_ids", _body(input_ids=[5.5, 6.0]), ("input_ids", "int")),
    BadInput("nested input_ids (a batch of 2)", _body(input_ids=[PROMPT[:30], PROMPT[30:]]), check=_answers(2, MAX_NEW)),
    BadInput("input_ids nested twice", _body(input_ids=[[PROMPT[:3]]]), ("input_ids", "int")),
    BadInput("text and input_ids", _body(text="hello"), ("text and input_ids",), plugin_refusal=True),
    BadInput("max_new_tokens -1", _sampling(max_new_tokens=-1), ("max_new_tokens",)),
    BadInput("max_new_tokens 10**9", _sampling(max_new_tokens=10**9), ("context length",)),
    BadInput("max_new_tokens 0", _sampling(max_new_tokens=0), check=_answers(1, 0)),
    BadInput("temperature -1", _sampling(temperature=-1), ("temperature",)),
    BadInput("temperature not a number", _sampling(temperature="hot"), ("temperature", "invalid type")),
    BadInput("top_p 2", _sampling(top_p=2), ("top_p",)),
    BadInput("top_k -5 (sampled)", _sampling(temperature=0.7, top_k=-5), ("top_k",)),
    BadInput("min_p 2", _sampling(min_p=2), ("min_p",)),
    BadInput("repetition_penalty -1", _sampling(repetition_penalty=-1), ("repetition_penalty",)),
    BadInput("frequency_penalty 5", _sampling(frequency_penalty=5), ("frequency_penalty",)),
    BadInput("return_logprob, top_logprobs_num 5", _body(return_logprob=True, top_logprobs_num=5),
             check=_logprobs("output_top_logprobs", MAX_NEW, 5)),  # fmt: skip
    BadInput("return_logprob, top_logprobs_num 10**6", _body(return_logprob=True, top_logprobs_num=10**6),
             ("top_logprobs_num",), kills_upstream=True, plugin_refusal=True),  # fmt: skip
    BadInput("return_logprob, logprob_start_len 0", _body(return_logprob=True, logprob_start_len=0),
             check=_logprobs("input_token_logprobs", len(PROMPT))),  # fmt: skip
    BadInput("return_logprob, logprob_start_len -5", _body(return_logprob=True, logprob_start_len=-5),
             ("logprob_start_len",), kills_upstream=True, plugin_refusal=True),  # fmt: skip
)


# --------------------------------------------------------------------------- sending
def _send(url: str, body: dict, timeout_s: float = REQUEST_S) -> Tuple[int, str, float]:
    started = time.monotonic()
    status, text = post(url, "/generate", json.dumps(body).encode(), timeout_s=timeout_s)
    return status, text, time.monotonic() - started


def _direct(prefill: Server, body: dict, room: int) -> dict:
    """``body`` for the prefill itself: the bootstrap fields a router adds (no decode will
    come, so only a body refused before the scheduler may go this way)."""
    bootstrap = {"bootstrap_host": "127.0.0.1", "bootstrap_port": prefill.endpoint.bootstrap_port, "bootstrap_room": room}
    return {**body, **bootstrap}


def _verdict(case: BadInput, status: int, text: str) -> Optional[str]:
    """Why the answer is wrong for ``case`` (None when it is right)."""
    if case.refused:
        if not 400 <= status < 500:
            return f"HTTP {status}, want a 4xx: {text[:200]}"
        return None if any(word in text for word in case.refused) else f"4xx not naming {case.refused}: {text[:200]}"
    if status != 200:
        return f"HTTP {status}, want it served: {text[:200]}"
    answer = json.loads(text)
    for one in answer if isinstance(answer, list) else [answer]:
        try:
            check_finished(one.get("meta_info") or {}, len(one.get("output_ids") or ()), case.body["sampling_params"]["max_new_tokens"])
        except RequestFailed as error:
            return str(error)
    return case.check(answer) if case.check is not None else None


def _serves_next(rec: Recorder, router: Router, label: str) -> None:
    try:
        generate(router.url, tokens("bad-input:next", 2 * PAGE_SIZE + 3), MAX_NEW)
    except RequestFailed as error:
        rec.expect(False, f"{router.name} did not serve the request after {label}: {error}")


def _through_router(rec: Recorder, router: Router, case: BadInput) -> str:
    """``case`` via ``router``: its verdict (a refusal within :data:`REFUSAL_S`); a note of
    what came back."""
    status, text, took = _send(router.url, case.body)
    problem = _verdict(case, status, text)
    if problem is None and case.refused and took > REFUSAL_S:
        problem = f"HTTP {status} after {took:.1f} s, want the refusal within {REFUSAL_S:.0f} s"
    rec.expect(problem is None, f"{case.name} via {router.name}: {problem}")
    return f"router {status} in {took:.1f} s"


def _one_case(rec: Recorder, session: ServingSession, case: BadInput, room: int) -> List[str]:
    """``case`` through the sharded router, straight to the sharded prefill (when refused)
    and through the reference router (unless the plugin refuses it or it kills upstream)."""
    rec.report.requests += 1
    sides = [_through_router(rec, session.sharded_router, case)]
    if case.refused:
        rec.report.requests += 1
        direct, text, took = _send(session.sharded.url, _direct(session.sharded, case.body, room))
        problem = _verdict(case, direct, text)
        rec.expect(problem is None, f"{case.name} to {session.sharded.name} directly: {problem}")
        sides.append(f"prefill {direct} in {took:.1f} s")
    if case.kills_upstream:
        sides.append("reference: not sent (upstream's scheduler dies on it)")
    elif case.plugin_refusal:
        sides.append(
            "reference: not sent (the decode refuses it; the reference's prefill would admit it and "
            f"wait out its PD bootstrap, {PD_BOOTSTRAP_TIMEOUT_S} s)"
        )
    else:
        rec.report.requests += 1
        reference, _, _ = _send(session.reference_router.url, case.body)
        sides.append(f"reference {reference}" + (" (upstream serves it)" if case.refused and reference == 200 else ""))
    _serves_next(rec, session.sharded_router, case.name)
    return sides


def bad_input(session: ServingSession) -> ScenarioReport:
    """Every :data:`CASES` body through the sharded router (and, for a refused one, straight
    to the sharded prefill): a 4xx naming its problem within :data:`REFUSAL_S`, or a
    correct answer; the sharded router serves the next request after each; both routers
    one after all."""
    rec = Recorder(session, "bad input")
    for room, case in enumerate(CASES, start=1):
        rec.note(f"{case.name}: " + ", ".join(_one_case(rec, session, case, room)))
    rec.pair("served after every bad input", tokens("bad-input:after", 2 * PAGE_SIZE + 5))
    return rec.finish()


def batch_of_300(session: ServingSession) -> ScenarioReport:
    """One ``/generate`` with 300 prompts through the sharded router: every prompt answered
    with its tokens (the decode admits about 14 at a time, so the last wait in the
    prefill's bootstrap queue for the whole batch: ``cluster.PD_BOOTSTRAP_TIMEOUT_S``)."""
    rec = Recorder(session, f"a batch of {BATCH_PROMPTS} prompts")
    prompts = [tokens(f"batch:{i}", 40) for i in range(BATCH_PROMPTS)]
    rec.report.requests += 1
    status, text, took = _send(session.sharded_router.url, _body(input_ids=prompts), timeout_s=BATCH_TIMEOUT_S)
    case = BadInput("batch", _body(input_ids=prompts), check=_answers(BATCH_PROMPTS, MAX_NEW))
    problem = _verdict(case, status, text)
    rec.expect(problem is None, f"{BATCH_PROMPTS} prompts via {session.sharded_router.name}: {problem}")
    rec.note(f"HTTP {status} in {took:.1f} s")
    rec.pair("served after the batch", tokens("batch:after", 2 * PAGE_SIZE + 5))
    return rec.finish()


def flush_after_warm_up(session: ServingSession) -> ScenarioReport:
    """The sequence that answered empty on main: a warm-up request (under a page), a
    ``/flush_cache`` to each prefill, then the first request with full pages, through both
    routers: both answer with all their tokens, identically. And the sharded prefill never
    builds SGLang's page-hash extension while serving (upstream builds it at the first L3
    query, which then waits for g++: ``jit_prebuild.py``): it was built before the sharded
    prefill was ready."""
    rec = Recorder(session, "first request after a warm-up and a flush")
    for router in (session.sharded_router, session.reference_router):
        rec.ask(router, "warm-up", WARM_UP_IDS, 2)
    for server in (session.sharded, session.reference):
        rec.expect(flush(server), f"/flush_cache failed on {server.name}")
    rec.pair("first full pages after the flush", tokens("flush-after-warm-up", 5 * PAGE_SIZE + 7), cold=True)
    library = session.cluster.prebuild.library
    if rec.expect(library.exists(), f"{NATIVE_HASH} was never built ({library})"):
        ready = _ready_at(session.sharded)
        built = library.stat().st_mtime
        rec.expect(built <= ready, f"{NATIVE_HASH} built {built - ready:.1f} s after {session.sharded.name} was ready: a request waited for g++")
    return rec.finish()


def _ready_at(server: Server) -> float:
    """The wall-clock time ``server`` became ready."""
    process = server.process
    return time.time() - (time.monotonic() - (process.started_at + (process.ready_after_s or 0.0)))


__all__ = ["BadInput", "CASES", "bad_input", "batch_of_300", "flush_after_warm_up"]
