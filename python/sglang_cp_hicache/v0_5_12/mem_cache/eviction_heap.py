"""Evictable-leaf sets with a persistent lazy priority queue (incremental eviction).

Upstream ``HiRadixCache.evict`` and ``evict_host`` rebuild a heap from every evictable
leaf on each call: O(leaves) per call, although a call usually frees a handful of nodes.
:class:`EvictableLeafSet` replaces the plain ``set`` the tree keeps its leaves in and
queues an entry whenever a node *enters* the set. Removal is lazy: an entry whose node
left the set is dropped when it reaches the front.

Exactness (eviction picks the victims a fresh rebuild would pick) needs keys that never
decrease while a node is a member. LRU and its relatives have such keys: access times come
from a monotonic clock, hit counts and priorities only grow. A stale entry is then too
small, never too large; at the front it is requeued with the node's current key, so the
first entry at the front whose key is current is the true minimum. Strategies whose key can
decrease (MRU, FILO) rebuild once per eviction call instead: upstream's cost and order.

The queue is a sorted run plus a heap. Under LRU most entries arrive in key order (a leaf
enters the set when it is created or touched, stamped with the current time), and those
are appended to the run in O(1); the rest (a parent that becomes a leaf, a requeued stale
entry) go to the heap. The front is the smaller of the two fronts. Eviction then pops most
victims from the run instead of sifting a heap of every leaf, whose entries are scattered
in memory: that sift was the largest cost per victim.
"""

from __future__ import annotations

import heapq
from collections import deque
from contextlib import closing
from typing import Any, Callable, Deque, Iterator, List, Optional, Tuple

from sglang.srt.mem_cache.evict_policy import (
    EvictionStrategy,
    FIFOStrategy,
    LFUStrategy,
    LRUStrategy,
    PriorityStrategy,
    SLRUStrategy,
)
from sglang.srt.mem_cache.radix_cache import TreeNode

Priority = Callable[[TreeNode], Any]  # an eviction strategy's get_priority
HeapEntry = Tuple[Any, int, TreeNode]

# Strategies whose key of a node never decreases (see the module docstring).
_NON_DECREASING_KEYS = (LRUStrategy, LFUStrategy, FIFOStrategy, PriorityStrategy, SLRUStrategy)
# Stale entries tolerated beyond twice the membership before the heap is rebuilt: the
# rebuild is O(members), so its cost per stale entry stays constant.
_COMPACT_SLACK = 1024


def keys_never_decrease(strategy: EvictionStrategy) -> bool:
    """Whether a node's priority under ``strategy`` can only grow while it is cached."""
    return type(strategy) in _NON_DECREASING_KEYS


class EvictableLeafSet(set):
    """Drop-in for the radix tree's leaf ``set`` that also keeps a lazy queue of members.

    Members pop in (priority, node id) order: node ids break ties, so the victim order is
    a function of tree state alone, identical on every rank. Invariants: every member has
    an entry whose priority is at most its current one; ``_run`` is sorted. Only ``add``
    and ``clear`` maintain the queue; they are the only growing and resetting calls the
    radix tree makes on its leaf sets (removal goes through ``remove``/``discard``).
    """

    def __init__(self, priority: Priority, keys_only_grow: bool) -> None:
        super().__init__()
        self._priority = priority
        self._keys_only_grow = keys_only_grow
        # Flat (priority, node id, node) entries: comparisons mostly end at a float. Entries
        # are only compared with ``<`` (equal priority and id fall through to TreeNode.__lt__).
        self._run: Deque[HeapEntry] = deque()  # entries that arrived in order
        self._heap: List[HeapEntry] = []  # the others

    def add(self, node: TreeNode) -> None:
        if node in self:
            return
        set.add(self, node)
        # _push, inlined: a leaf enters the set on every unlock of the ack and request paths.
        entry = (self._priority(node), node.id, node)
        run = self._run
        if not run or not entry < run[-1]:
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)
        if len(run) + len(self._heap) > 2 * len(self) + _COMPACT_SLACK:
            self.rebuild()

    def clear(self) -> None:
        super().clear()
        self._run.clear()
        self._heap.clear()

    def rebuild(self) -> None:
        """One entry per member, with its current priority."""
        # In place: a victims() iteration in progress keeps reading the same containers.
        entries = [(self._priority(node), node.id, node) for node in self]
        self._run.clear()
        self._heap.clear()
        if self._keys_only_grow:
            entries.sort()
            self._run.extend(entries)
        else:  # rebuilt before every eviction: upstream's heapify, not a sort
            self._heap.extend(entries)
            heapq.heapify(self._heap)

    def heap_size(self) -> int:
        """Entries held, stale ones included (bounded by the compaction rule)."""
        return len(self._run) + len(self._heap)

    def victims(self, eligible: Optional[Callable[[TreeNode], bool]] = None) -> Iterator[TreeNode]:
        """Eligible members in the order a heap rebuilt from the set would pop them.

        The caller evicts each yielded node (which leaves the set) before asking for the
        next, so a parent that becomes a leaf meanwhile competes in the same call, as in
        upstream. Each member is considered once per iteration; members that are skipped
        (not ``eligible``) or still members when the iteration ends keep an entry for later
        calls. Close the iterator (``contextlib.closing``) when stopping early.
        """
        if not self._keys_only_grow:
            self.rebuild()
        run, heap, priority_of = self._run, self._heap, self._priority
        popped = set()
        try:
            while run or heap:
                from_run = bool(run) and not (heap and heap[0] < run[0])
                priority, node_id, node = run.popleft() if from_run else heapq.heappop(heap)
                if node not in self or node in popped:
                    continue
                current = priority_of(node)
                if current != priority:
                    self._queue((current, node_id, node))
                    continue
                popped.add(node)
                if eligible is None or eligible(node):
                    yield node
        finally:
            for node in popped:
                if node in self:
                    self._push(node)

    def ordered(self) -> List[TreeNode]:
        """All members in victim order, without consuming anything (invariant checks)."""
        order: List[TreeNode] = []
        with closing(self.victims()) as members:
            order.extend(members)
        return order

    def _push(self, node: TreeNode) -> None:
        self._queue((self._priority(node), node.id, node))

    def _queue(self, entry: HeapEntry) -> None:
        run = self._run
        if not run or not entry < run[-1]:
            run.append(entry)
        else:
            heapq.heappush(self._heap, entry)
