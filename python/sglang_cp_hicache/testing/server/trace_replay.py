"""Trace replay: the simulator's JSONL traces sent through the serving cluster, each request
answered by the sharded prefill's router and by its reference's (``--trace``); prompts
thinned by a rule of position alone so shared prefixes stay shared."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional, Sequence

from sglang_cp_hicache.testing.server.launch import CONTEXT_LENGTH
from sglang_cp_hicache.testing.server.recorder import FIRST_TOKEN_ID, MAX_NEW, VOCAB_SIZE, Recorder, ScenarioReport
from sglang_cp_hicache.testing.server.scenarios import Scenario
from sglang_cp_hicache.testing.server.session import ServingSession


def scaled_prompt(token_ids: Sequence[int], factor: float) -> List[int]:
    """``token_ids`` thinned to about ``factor`` of its length by a rule of the position alone
    (position ``i`` kept when ``floor((i + 1) * factor)`` steps up), so a shared prefix stays a
    shared prefix; ids folded into the tiny vocabulary past its special tokens."""
    span = VOCAB_SIZE - FIRST_TOKEN_ID
    kept = [t for i, t in enumerate(token_ids) if int((i + 1) * factor) > int(i * factor)]
    return [FIRST_TOKEN_ID + t % span for t in kept]


def trace_prompts(path: Path, seed: int = 0, limit: Optional[int] = None) -> List[List[int]]:
    """The simulator's JSONL trace (``sim/workload.py``: exact ids or lengths synthesised from
    seeded labels), prompts scaled so the longest fits the tiny model's context."""
    from sglang_cp_hicache.sim.workload import load_trace

    requests = load_trace(str(path), seed=seed)[:limit]
    longest = max(len(r.token_ids) for r in requests)
    factor = min(1.0, (CONTEXT_LENGTH - MAX_NEW - 1) / longest)
    return [scaled_prompt(r.token_ids, factor) for r in requests]


def trace_replay(path: Path, seed: int = 0, limit: Optional[int] = None) -> Scenario:
    """A scenario replaying ``path`` against the sharded server and its reference."""

    def run(session: ServingSession) -> ScenarioReport:
        rec = Recorder(session, f"trace {path.name}")
        for i, prompt in enumerate(trace_prompts(path, seed, limit)):
            rec.pair(f"request {i}", prompt, cold=i == 0)
        return rec.finish()

    return Scenario(f"trace:{path.name}", run)


__all__ = ["scaled_prompt", "trace_prompts", "trace_replay"]
