"""Counts torch.distributed collectives issued while the driver is inside a cache call.

CP HiCache must not add a collective to the scheduler path: the replicated scheduler
state is kept identical by construction, and the only sync allowed is upstream's MIN
all-reduce of finished write acks in ``HiRadixCache.writing_check``. Every public
collective of ``torch.distributed`` (and its ``distributed_c10d`` module, which callers
may import directly) is wrapped; only the outermost call of a nested one is counted.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from collections import Counter
from typing import Any, Callable, Dict, Iterator, List, Tuple

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

COLLECTIVE_NAMES = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor",
    "all_gather_object", "all_gather_coalesced", "all_to_all", "all_to_all_single",
    "barrier", "monitored_barrier", "broadcast", "broadcast_object_list", "gather",
    "gather_object", "reduce", "reduce_scatter", "reduce_scatter_tensor", "scatter",
    "scatter_object_list", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list",
)  # fmt: skip


class CollectiveCounter:
    """Install once per process; counting is on only inside :meth:`counting`, and only
    for the installing (scheduler) thread: HiCache's storage threads run their own
    collectives on their own groups, off the scheduler path."""

    def __init__(self) -> None:
        self._thread = threading.get_ident()
        self.enabled = False
        self.in_writing_check = False
        self.allowed = 0  # writing_check's MIN all-reduces
        self.hot_path: Counter = Counter()  # every other collective, by name
        self._depth = 0
        self._originals: List[Tuple[Any, str, Callable]] = []

    def install(self) -> None:
        for module in (dist, c10d):
            for name in COLLECTIVE_NAMES:
                original = getattr(module, name, None)
                if original is None:
                    continue
                self._originals.append((module, name, original))
                setattr(module, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for module, name, original in reversed(self._originals):
            setattr(module, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable) -> Callable:
        @functools.wraps(original)
        def counted(*args, **kwargs):
            if threading.get_ident() != self._thread:
                return original(*args, **kwargs)
            if self.enabled and self._depth == 0:
                self._record(name, args, kwargs)
            self._depth += 1
            try:
                return original(*args, **kwargs)
            finally:
                self._depth -= 1

        return counted

    def _record(self, name: str, args: tuple, kwargs: Dict[str, Any]) -> None:
        if name == "all_reduce" and self.in_writing_check:
            op = kwargs.get("op", args[1] if len(args) > 1 else dist.ReduceOp.SUM)
            if op == dist.ReduceOp.MIN:
                self.allowed += 1
                return
        self.hot_path[name] += 1

    @contextlib.contextmanager
    def counting(self) -> Iterator[None]:
        previous, self.enabled = self.enabled, True
        try:
            yield
        finally:
            self.enabled = previous

    @contextlib.contextmanager
    def in_writing_check_scope(self) -> Iterator[None]:
        """Inside ``writing_check``: the one place a MIN all-reduce is allowed."""
        previous, self.in_writing_check = self.in_writing_check, True
        try:
            yield
        finally:
            self.in_writing_check = previous


def all_ranks_equal(value: int, group: Any) -> bool:
    """Outside the timed path: does every rank of ``group`` hold the same int64 ``value``?"""
    if group is None or dist.get_world_size(group=group) == 1:
        return True
    mine = torch.tensor([value], dtype=torch.int64)
    gathered = [torch.zeros_like(mine) for _ in range(dist.get_world_size(group=group))]
    dist.all_gather(gathered, mine, group=group)
    return all(bool((g == mine).all()) for g in gathered)
