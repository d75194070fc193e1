"""The L3 tier's KV events between a storage write and its ack, and the blocks a stream has
published as stored on that tier (SGLang-free).

A storage write's ``BlockStored`` events are made when the write is queued (the node's
pages, its parent link and its namespace are known then and may change before the ack:
a split leaves the acked node with only its suffix) and published when the write is acked
on every rank (upstream's MIN over the ranks' ready acks), truncated to the pages written.
:class:`L3EventLog` keeps them in between, keyed by the storage operation's id, and
remembers which block hashes it has published as stored per medium, so that a clear or a
detach of the tier can retract exactly those (:meth:`L3EventLog.retract`).

Invariants: an operation's events are released at most once; a medium's tracked hashes are
the ones published as stored and not retracted since, oldest first, at most
``max_tracked`` of them (beyond that the oldest is forgotten and counted: a later retract
no longer names it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Container, Dict, Generic, Iterable, List, Optional, Tuple, TypeVar

#: Block hashes tracked for a retract, all media together (about 100 bytes each; a page of
#: the models served here is MiBs of KV, so this is far below the L3 bytes it stands for).
MAX_TRACKED_BLOCKS = 1 << 20

E = TypeVar("E")


@dataclass(frozen=True)
class HeldWrite(Generic[E]):
    """One storage write's ``BlockStored`` events (``events``, in page order, already
    coalesced as the recorder coalesces them) on ``medium``."""

    medium: str
    events: Tuple[E, ...]


class L3EventLog(Generic[E]):
    """One cache's L3 events on its publisher rank; see the module docstring."""

    def __init__(self, max_tracked: int = MAX_TRACKED_BLOCKS) -> None:
        if max_tracked < 1:
            raise ValueError(f"max_tracked must be positive, got {max_tracked}")
        self.max_tracked = max_tracked
        self._held: Dict[int, HeldWrite[E]] = {}
        self._tracked: Dict[int, str] = {}  # block hash -> medium, oldest first
        self.forgotten = 0  # tracked hashes dropped for room

    @property
    def held_operations(self) -> int:
        return len(self._held)

    def hold(self, operation_id: int, write: HeldWrite[E]) -> None:
        if operation_id in self._held:
            raise RuntimeError(f"storage operation {operation_id} already holds its events")
        self._held[operation_id] = write

    def release(self, operation_id: int) -> Optional[HeldWrite[E]]:
        """The held write of an acked operation (None: none held), no longer held."""
        return self._held.pop(operation_id, None)

    def forget_except(self, live_ids: Container[int]) -> int:
        """Drop held writes whose operation is no longer in flight (acked without being
        seen, or dropped by a reset or a detach); how many."""
        stale = [op_id for op_id in self._held if op_id not in live_ids]
        for op_id in stale:
            del self._held[op_id]
        return len(stale)

    def track_stored(self, medium: str, block_hashes: Iterable[int]) -> None:
        """Remember ``block_hashes`` as published stored on ``medium`` (a re-store moves a
        hash to the newest end)."""
        for block_hash in block_hashes:
            self._tracked.pop(block_hash, None)
            self._tracked[block_hash] = medium
        while len(self._tracked) > self.max_tracked:
            del self._tracked[next(iter(self._tracked))]
            self.forgotten += 1

    def tracked(self, medium: str) -> List[int]:
        return [h for h, m in self._tracked.items() if m == medium]

    def retract(self) -> Dict[str, List[int]]:
        """Every tracked hash by medium, oldest first; nothing is tracked or held after."""
        by_medium: Dict[str, List[int]] = {}
        for block_hash, medium in self._tracked.items():
            by_medium.setdefault(medium, []).append(block_hash)
        self._tracked.clear()
        self._held.clear()
        return by_medium


__all__ = ["HeldWrite", "L3EventLog", "MAX_TRACKED_BLOCKS"]
