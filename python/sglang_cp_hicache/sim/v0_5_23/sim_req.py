"""The 0.5.23 driver's request records: :class:`SimReq` (one trace request and its real
``Req``, one per attempt) and :class:`RejectedKeys` (the keys of inserts the tree declined,
to price the hits they cost)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from typing import Any, Dict, List, Sequence, Tuple

import numpy as np

from sglang_cp_hicache.sim.engine import TraceAttempt
from sglang_cp_hicache.sim.v0_5_23.observed_cache import DeclinedInsert


@dataclass(eq=False)
class SimReq(TraceAttempt):
    """One trace request and its real ``Req`` (one per attempt: a retraction re-queues a
    fresh one), with what the driver records of its first chunk."""

    req: Any = None  # sglang.srt.managers.schedule_batch.Req
    device_hit: int = 0
    host_hit: int = 0

    def __post_init__(self) -> None:
        from sglang.srt.managers.schedule_batch import Req
        from sglang.srt.sampling.sampling_params import SamplingParams

        if self.req is None:
            self.req = Req(
                rid=self.rid,
                origin_input_text="",
                origin_input_ids=array("q", self.request.token_ids),
                sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
            )

    @property
    def last_chunk(self) -> bool:
        return self.req.extend_end == len(self.prompt)


@dataclass
class RejectedKeys:
    """Keys of inserts the tree declined, to price the hits they cost: the page-aligned
    prompt prefix a later request shares with a declined key, beyond what it matched.
    Indexed by first page (only keys with the same first page can share a prefix)."""

    page_size: int
    by_first_page: Dict[Tuple[int, ...], List[np.ndarray]] = field(default_factory=dict)

    def add(self, declined: DeclinedInsert) -> None:
        key = np.asarray(declined.token_ids, dtype=np.int64)
        if len(key) >= self.page_size:
            self.by_first_page.setdefault(tuple(key[: self.page_size]), []).append(key)

    def potential_match(self, prompt: Sequence[int]) -> int:
        """The longest page-aligned prefix of ``prompt[:-1]`` any declined key holds."""
        tokens = np.asarray(prompt[: len(prompt) - 1], dtype=np.int64)
        best = 0
        for key in self.by_first_page.get(tuple(tokens[: self.page_size]), ()):
            n = min(len(key), len(tokens))
            differ = np.nonzero(key[:n] != tokens[:n])[0]
            common = int(differ[0]) if len(differ) else n
            best = max(best, common // self.page_size * self.page_size)
        return best


__all__ = ["RejectedKeys", "SimReq"]
