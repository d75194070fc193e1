"""Workloads: a seeded multi-turn generator and a JSONL trace reader, both yielding prompts.

A request is the full prompt of one prefill (token ids). Multi-turn sessions grow their
prompt turn by turn (previous prompt + the model's reply + the new user turn) and start
from one of a few shared system prompts, so requests reuse prefixes across and within
sessions. Token ids are a pure function of the seed, so every rank and every replay sees
the same trace.

JSONL trace, one request per line (blank lines are skipped)::

    {"session_id": "a", "token_ids": [1, 2, 3, ...]}           # exact prompt
    {"session_id": "a", "new_tokens": 128,                     # or lengths: the session's
     "system_prompt": "sys0", "system_prompt_len": 256,        # previous prompt + reply +
     "reply_tokens": 48}                                       # new tokens (synthesised)

``system_prompt``/``system_prompt_len`` only matter on a session's first request; the same
system prompt id always yields the same tokens, so sessions share it. ``reply_tokens``
(default 0) is appended before the new tokens when the session has a previous prompt.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.sim.config import SimConfig


class TraceError(ValueError):
    """A trace line is malformed; the message names the file and line."""


@dataclass(frozen=True)
class Request:
    index: int
    session_id: str
    token_ids: Tuple[int, ...]


@dataclass
class _Session:
    session_id: str
    prompt: List[int] = field(default_factory=list)
    turns: int = 0


def _tokens(label: str, count: int, vocab_size: int) -> List[int]:
    # random.Random(str) seeds from a SHA-512 of the string: stable across processes,
    # unlike hash(), so every rank synthesises the same ids.
    rng = random.Random(label)
    return [rng.randrange(vocab_size) for _ in range(count)]


def generate_workload(cfg: SimConfig) -> List[Request]:
    """Seeded multi-turn sessions over shared system prompts (see module docstring)."""
    rng = random.Random(cfg.seed)
    system_prompts = [
        _tokens(f"{cfg.seed}:system:{i}", cfg.system_prompt_len, cfg.vocab_size)
        for i in range(cfg.num_system_prompts)
    ]
    active: List[_Session] = []
    next_session = 0
    requests: List[Request] = []
    while len(requests) < cfg.num_requests:
        turn_len = rng.randint(cfg.turn_len_min, cfg.turn_len_max)
        session: Optional[_Session] = None
        if active and (len(active) >= cfg.max_active_sessions or rng.random() < cfg.continue_prob):
            session = rng.choice(active)
            label = f"{cfg.seed}:{session.session_id}"
            reply = _tokens(f"{label}:reply:{session.turns}", cfg.reply_len, cfg.vocab_size)
            new = _tokens(f"{label}:turn:{session.turns}", turn_len, cfg.vocab_size)
            prompt = session.prompt + reply + new
            if len(prompt) > cfg.max_prompt_len:
                active.remove(session)  # the conversation ends; a new one starts instead
                session = None
        if session is None:
            session = _Session(f"s{next_session}")
            next_session += 1
            system = rng.choice(system_prompts) if system_prompts else []
            new = _tokens(f"{cfg.seed}:{session.session_id}:turn:0", turn_len, cfg.vocab_size)
            prompt = (system + new)[: cfg.max_prompt_len]
            active.append(session)
        session.prompt = prompt
        session.turns += 1
        requests.append(Request(len(requests), session.session_id, tuple(prompt)))
    return requests


def _require_int(record: dict, key: str, where: str, default: Optional[int] = None) -> int:
    value = record.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {key!r} must be a non-negative integer, got {value!r}")
    return value


def load_trace(path: str, seed: int = 0, vocab_size: int = 32000) -> List[Request]:
    """Read a JSONL trace (see module docstring)."""
    sessions: Dict[str, _Session] = {}
    system_lens: Dict[str, int] = {}
    requests: List[Request] = []
    with open(Path(path), encoding="utf-8") as handle:
        for line_no, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise TraceError(f"{where}: not JSON ({exc})") from None
            if not isinstance(record, dict) or "session_id" not in record:
                raise TraceError(f"{where}: each line must be an object with 'session_id'")
            session_id = str(record["session_id"])
            session = sessions.setdefault(session_id, _Session(session_id))
            if "token_ids" in record:
                ids = record["token_ids"]
                if not isinstance(ids, list) or not all(
                    isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids
                ):
                    raise TraceError(f"{where}: 'token_ids' must be a list of non-negative ints")
                prompt = list(ids)
            elif "new_tokens" in record:
                new_len = _require_int(record, "new_tokens", where)
                if session.turns == 0:
                    prompt = _system_prompt(record, system_lens, where, seed, vocab_size)
                else:
                    reply_len = _require_int(record, "reply_tokens", where, default=0)
                    prompt = session.prompt + _tokens(
                        f"{seed}:{session_id}:reply:{session.turns}", reply_len, vocab_size
                    )
                prompt += _tokens(f"{seed}:{session_id}:turn:{session.turns}", new_len, vocab_size)
            else:
                raise TraceError(f"{where}: needs 'token_ids' or 'new_tokens'")
            if len(prompt) < 2:
                raise TraceError(f"{where}: a prompt needs at least 2 tokens, got {len(prompt)}")
            session.prompt = prompt
            session.turns += 1
            requests.append(Request(len(requests), session_id, tuple(prompt)))
    if not requests:
        raise TraceError(f"{path}: no requests")
    return requests


def _system_prompt(
    record: dict, system_lens: Dict[str, int], where: str, seed: int, vocab_size: int
) -> List[int]:
    if "system_prompt" not in record:
        return []
    system_id = str(record["system_prompt"])
    if "system_prompt_len" in record:
        length = _require_int(record, "system_prompt_len", where)
        if system_lens.setdefault(system_id, length) != length:
            raise TraceError(
                f"{where}: system prompt {system_id!r} has length {system_lens[system_id]} "
                f"elsewhere, {length} here"
            )
    elif system_id not in system_lens:
        raise TraceError(
            f"{where}: first use of system prompt {system_id!r} needs 'system_prompt_len'"
        )
    return _tokens(f"{seed}:system:{system_id}", system_lens[system_id], vocab_size)


def load_workload(cfg: SimConfig) -> List[Request]:
    if cfg.trace_path is not None:
        return load_trace(cfg.trace_path, cfg.seed, cfg.vocab_size)
    return generate_workload(cfg)


# ------------------------------------------------------------------------- batching
def _pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size)


def pool_limits(cfg: SimConfig) -> Dict[str, int]:
    """Pages one batch may need at most, per pool that will replay the trace.

    The CP run has ``cp_size`` lanes of ``physical_tokens / page_size`` pages; a request's
    pages spread over lanes, each lane taking at most ``ceil(pages / cp) + 1`` (one spare
    for an unbalanced split). The baseline keeps the same physical pool on one rank.
    """
    lane_pages = cfg.physical_tokens // cfg.page_size
    limits = {"cp_lane": lane_pages}
    if cfg.baseline:
        limits["baseline"] = lane_pages
    return limits


def plan_steps(requests: Sequence[Request], cfg: SimConfig) -> List[List[Request]]:
    """Greedy prefill batches of up to ``batch_size`` requests that fit every pool.

    Mirrors the scheduler's admission budget: a batch is admitted only if all its
    sequences fit the device pool at once (prefix pages counted, conservatively, per
    request). Raises ValueError for a request that cannot fit alone.
    """
    limits = pool_limits(cfg)

    def need(request: Request) -> Dict[str, int]:
        pages = _pages(len(request.token_ids), cfg.page_size) + 1  # +1: the scheduler's spare page
        needs = {"cp_lane": math.ceil(pages / cfg.cp_size) + 1}
        if "baseline" in limits:
            needs["baseline"] = pages
        return needs

    steps: List[List[Request]] = []
    current: List[Request] = []
    used = {name: 0 for name in limits}
    for request in requests:
        needs = need(request)
        for name, pages in needs.items():
            if pages > limits[name]:
                raise ValueError(
                    f"request {request.index} ({len(request.token_ids)} tokens) needs {pages} "
                    f"pages of the {name} pool, which has {limits[name]}: raise "
                    f"physical_tokens or lower max_prompt_len"
                )
        fits = all(used[name] + needs[name] <= limits[name] for name in limits)
        if current and (len(current) >= cfg.batch_size or not fits):
            steps.append(current)
            current, used = [], {name: 0 for name in limits}
        current.append(request)
        for name in limits:
            used[name] += needs[name]
    if current:
        steps.append(current)
    return steps
