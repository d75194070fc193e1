"""The PD router's prefill choice in the fleet model (imports no SGLang).

``round_robin``: request ``k`` goes to the next instance in turn. ``cache_aware``: to the
instance whose device + host tiers match the longest prefix of the request (ties: the
next in turn). sglang-router's ``cache_aware`` keeps an approximate radix tree per worker
of the prompts it routed and picks the longest match when the best match ratio passes its
``cache_threshold`` (0.3 by default), falling back to the least loaded worker when loads
differ past ``balance_abs_threshold`` / ``balance_rel_threshold``. Here the match is read
from each instance's real tiers (what the router's tree approximates, evictions included)
and load is balanced by the round: each instance takes ``batch_size`` requests per round,
so a full instance is never chosen.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, List, Sequence

ROUTERS = ("round_robin", "cache_aware")


@dataclass
class Router:
    """Picks an instance per request; ``turn`` is the round-robin pointer (ties too)."""

    policy: str
    instances: int
    turn: int = 0

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ValueError(f"router must be one of {list(ROUTERS)}, got {self.policy!r}")

    def pick(self, open_instances: Sequence[int], match_pages: Callable[[int], int]) -> int:
        """One of ``open_instances`` (those with room this round); ``match_pages(i)`` is
        instance ``i``'s device + host prefix match of the request, in pages."""
        order = self._in_turn(open_instances)
        if self.policy == "cache_aware":
            best = max(match_pages(i) for i in order)
            order = [i for i in order if match_pages(i) == best]
        chosen = order[0]
        self.turn = (chosen + 1) % self.instances
        return chosen

    def _in_turn(self, open_instances: Sequence[int]) -> List[int]:
        return sorted(open_instances, key=lambda i: (i - self.turn) % self.instances)


__all__ = ["ROUTERS", "Router"]
