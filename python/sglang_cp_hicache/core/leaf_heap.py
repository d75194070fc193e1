"""A persistent lazy candidate heap over a leaf set someone else owns (imports no SGLang).

A lane planner asks, on each plan, for a tier's evictable leaves in (priority, node id)
order. Rebuilding a heap of every leaf per plan costs a Python key call per leaf, although
a plan usually takes a handful. :class:`LazyLeafHeap` keeps one heap across plans instead:
at most one entry per node, validated when it reaches the front. An entry whose node is no
longer a member (evicted, locked, no longer a leaf: the owner's set dropped it) is dropped;
one whose key changed is requeued with the current key.

Exactness (the order a fresh heap over the members would pop) needs keys that never
decrease, even while a node is out of the set (LRU and its relatives: access times from a
monotonic counter, hit counts and priorities only grow). Every member's entry then holds
at most its current key, so the first front entry whose key is current is the true
minimum. Strategies whose key can decrease are rebuilt on every call (``keys_only_grow``
False): a fresh heap, the cost and order of a rebuild per plan.

The owner's set cannot tell the heap who joined it (on the 0.5.23 line it is upstream's
tree core's plain ``set``), so each call first queues the members without an entry: one
set difference, in C, instead of a key call per leaf. A yielded node loses its entry; if
it is still a member at the next call (planned but not evicted), that call queues it again.
"""

from __future__ import annotations

import heapq
from typing import AbstractSet, Any, Callable, Iterator, List, Set, Tuple

Priority = Callable[[Any], Any]
HeapEntry = Tuple[Any, int, Any]

# Entries tolerated beyond twice the membership before the heap is rebuilt: a rebuild is
# O(members), so its cost per stale entry stays constant.
_COMPACT_SLACK = 1024


class LazyLeafHeap:
    """One tier's persistent candidate order. Invariants (between calls): each node in
    ``_queued`` has exactly one entry in ``_heap`` and no other node has one; a member's
    entry key is at most its current key (when ``keys_only_grow``). One priority function
    per heap: the caller passes the same key on every call."""

    def __init__(self, keys_only_grow: bool) -> None:
        self.keys_only_grow = keys_only_grow
        self._heap: List[HeapEntry] = []
        self._queued: Set[Any] = set()

    def __len__(self) -> int:
        """Entries held, stale ones included (bounded by the compaction rule)."""
        return len(self._heap)

    def candidates(self, members: AbstractSet[Any], priority: Priority) -> Iterator[Any]:
        """``members`` in (priority, node id) order, lazily. ``members`` must not change
        while the iterator is read (a plan reads, then evicts); nodes are hashable and
        have a unique ``id``."""
        self._sync(members, priority)
        return self._pop_in_order(members, priority)

    def _sync(self, members: AbstractSet[Any], priority: Priority) -> None:
        heap, queued = self._heap, self._queued
        if not self.keys_only_grow or len(heap) > 2 * len(members) + _COMPACT_SLACK:
            heap[:] = [(priority(node), node.id, node) for node in members]
            heapq.heapify(heap)
            queued.clear()
            queued.update(members)
            return
        joined = members - queued
        for node in joined:
            heapq.heappush(heap, (priority(node), node.id, node))
        queued |= joined

    def _pop_in_order(self, members: AbstractSet[Any], priority: Priority) -> Iterator[Any]:
        heap, queued = self._heap, self._queued
        while heap:
            key, node_id, node = heap[0]
            if node not in members:
                heapq.heappop(heap)
                queued.discard(node)
                continue
            current = priority(node)
            if current != key:  # grown since queued: requeue at its current key
                heapq.heapreplace(heap, (current, node_id, node))
                continue
            heapq.heappop(heap)
            queued.discard(node)
            yield node


__all__ = ["LazyLeafHeap", "Priority"]
