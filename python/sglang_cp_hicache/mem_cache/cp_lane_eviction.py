"""Lane-targeted victim planning for CP HiCache (device and host tiers alike).

Every capacity decision under CP shared KV is per owner lane: a load needs device pages
on the lanes its write-time owners name, a backup needs host pages on the lanes its
device pages live on. :func:`plan_lane_victims` picks, in eviction order, only leaves that
free pages on a lane still short, and stops as soon as no lane is short. It plans without
evicting: a parent becomes a candidate once every child it waits for is planned, so the
plan is exactly what evicting in plan order will free. When the short lanes cannot be
covered it returns None and the caller evicts nothing.

The plan is a pure function of replicated state (tree, priorities, node ids, per-node
lane page counts, lane free counts): every rank plans the same victims, no collective.
"""

from __future__ import annotations

import heapq
from contextlib import closing
from typing import Any, Callable, Iterator, List, Optional, Set, Tuple

import numpy as np
from sglang.srt.mem_cache.radix_cache import TreeNode

# The node's pages per owner lane (int64 [cp_size]) in the tier being planned.
LanePages = Callable[[TreeNode], np.ndarray]
# The parent that becomes a leaf of the tier once ``node`` and the planned set are gone.
FreedParent = Callable[[TreeNode, Set[TreeNode]], Optional[TreeNode]]
# A node's eviction key without the id tie-break (the strategy's priority).
Priority = Callable[[TreeNode], Any]


def plan_lane_victims(
    candidates: Iterator[TreeNode],
    deficit: np.ndarray,
    lane_pages: LanePages,
    freed_parent: FreedParent,
    priority: Priority,
) -> Optional[List[TreeNode]]:
    """Victims, in eviction order, that together free ``deficit`` pages per lane.

    ``candidates``: the tier's evictable leaves in (priority, node id) order (the leaf
    set's ``victims()`` iterator; closed here, which keeps every leaf in the set). A
    candidate that frees nothing on a lane still short is never planned.
    """
    need = np.asarray(deficit, dtype=np.int64).copy()
    planned: List[TreeNode] = []
    planned_set: Set[TreeNode] = set()
    freed_parents: List[Tuple[Any, int, TreeNode]] = []
    with closing(candidates):
        head = next(candidates, None)
        while (need > 0).any():
            if freed_parents and (
                head is None or freed_parents[0][:2] < (priority(head), head.id)
            ):
                node = heapq.heappop(freed_parents)[2]
            elif head is not None:
                node, head = head, next(candidates, None)
            else:
                return None
            pages = lane_pages(node)
            if not (pages[need > 0] > 0).any():
                continue
            planned.append(node)
            planned_set.add(node)
            need -= pages
            parent = freed_parent(node, planned_set)
            if parent is not None:
                heapq.heappush(freed_parents, (priority(parent), parent.id, parent))
    return planned
