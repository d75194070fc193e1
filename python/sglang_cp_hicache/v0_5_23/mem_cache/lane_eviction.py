"""Lane-aware device eviction on SGLang 0.5.23's native KV sharding.

Upstream's sharded allocator admits on the tightest owner lane (``available_size`` = the
min-class floor x N), and its device eviction repeats a plain LRU ``evict`` until that floor
is met (``mem_cache/common.py:292-320``, after ``evict_for_alloc``'s LRU walk,
``allocator/base.py:155-170``): it flushes cache on lanes that were never short. Under
the plugin's flag, room is made instead by the shared planner
(:func:`sglang_cp_hicache.core.lane_eviction.plan_lane_victims`): victims in (priority,
node id) order that hold pages on a short lane only, stopping once every short lane is
covered; an uncoverable deficit evicts nothing and is a counted refusal. A short lane
held only by inner nodes is reached through them: the leaves under such a node are
evicted too (the planner's ``parent_of``), and only those the plan needs.

Three hooks (``v0_5_23.hooks``), each upstream's function unchanged when the flag is off or
the allocator is not the sharded one:

* ``allocation:alloc_paged_token_slots_extend`` (AROUND): the extend's exact per-lane
  draws (the allocator's own rule: ``(b_i + P) % N`` per position-page, a new chain drawn
  from the least-full lane at its turn) are made room for, then upstream's function runs
  with its own conservative (one page per lane per request) eviction skipped. So an extend
  the free lanes can already hold evicts nothing. A refusal leaves the allocator short and
  upstream's "Prefill out of memory" stands, as when upstream's eviction runs dry.
* ``UnifiedRadixCache.evict_for_alloc`` (AROUND): a load-back's (and any other caller's)
  room for upstream's own target, the min-class floor reaching ``available + num_tokens``;
  a refusal leaves the floor short, which ``_load_back_transfers`` answers by skipping the
  load (the request recomputes), as when upstream's walk runs dry.
* ``common:_evict_until_allocatable`` (AROUND): its only caller
  (``BaseTokenToKVPoolAllocator.evict_to_free_tokens``) has just called the lane-aware
  ``evict_for_alloc`` for the same floor, so its extra plain-LRU passes are skipped.

Every decision reads replicated state only (the logical tree, node ids, rotation phases,
the mirrored lane free counts): every rank evicts the same nodes, no collective.
"""

from __future__ import annotations

import contextvars
import heapq
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set

from sglang_cp_hicache.core.lane_eviction import (
    cyclic_lane_counts,
    extend_lane_demand,
    lane_deficit,
    plan_lane_victims,
)
from sglang_cp_hicache.v0_5_23.server_args import cp_shared_kv_enabled

logger = logging.getLogger(__name__)

# Set while upstream's extend allocation runs after the plugin made its exact room: the
# conservative eviction inside it must not evict again.
_extend_room_made: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "cp_hicache_extend_room_made", default=False
)


@dataclass
class LaneEvictionStats:
    """This process's lane-aware device eviction, in replicated counts (equal on every
    rank): plans carried out, refusals (an uncoverable deficit: nothing evicted), victims
    and tokens evicted by plans."""

    plans: int = 0
    refusals: int = 0
    victims: int = 0
    evicted_tokens: int = 0


STATS = LaneEvictionStats()


def _flag_on() -> bool:
    from sglang.srt.runtime_context import get_server_args

    return cp_shared_kv_enabled(get_server_args())


def _is_sharded(allocator: Any) -> bool:
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    return isinstance(allocator, PageInterleavePoolAllocator) and allocator.shard_size > 1


def lane_aware(tree_cache: Any) -> bool:
    """Whether ``tree_cache``'s device eviction is the plugin's: the flag is on and the
    cache is a ``UnifiedRadixCache`` over upstream's sharded allocator."""
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache

    return (
        isinstance(tree_cache, UnifiedRadixCache)
        and _is_sharded(tree_cache.token_to_kv_pool_allocator)
        and _flag_on()
    )


def _parent_of(node: Any) -> Any:
    return node.parent


@dataclass
class DeviceLaneEvictor:
    """Makes per-lane device room on one ``UnifiedRadixCache`` (Python tree core) over a
    ``PageInterleavePoolAllocator``. Demands and free counts are in pages per owner lane.

    A node's pages per lane come from its rotation phase (host metadata upstream keeps for
    the same reason: reading the device locs would sync the stream); its FULL value is
    page-aligned and its owners one cyclic run (upstream refuses inserts that join runs).
    """

    cache: Any  # UnifiedRadixCache
    allocator: Any  # PageInterleavePoolAllocator

    @property
    def lanes(self) -> int:
        return self.allocator.shard_size

    @property
    def page_size(self) -> int:
        return self.allocator.page_size

    def free_pages(self) -> List[int]:
        return self.allocator.class_free_page_counts()

    def floor_demand(self, tokens: int) -> List[int]:
        """Pages per lane for the min-class floor to reach ``tokens`` (upstream's gate)."""
        span = self.lanes * self.page_size
        return [-(-tokens // span)] * self.lanes

    # ----------------------------------------------------------------- the planner's view
    def _full(self, node: Any) -> Any:
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        return node.component_data[ComponentType.FULL]

    def lane_pages(self, node: Any) -> List[int]:
        phase = self.cache.tree_core.rotation_phase_of(node.id)
        if phase is None:
            raise RuntimeError(
                f"cp_hicache lane eviction: device node {node.id} has no rotation base under "
                "KV sharding; its pages' owner lanes are unknown"
            )
        return cyclic_lane_counts(phase, len(self._full(node).value) // self.page_size, self.lanes)

    def priority(self, node: Any) -> Any:
        return self.cache.tree_core.eviction_strategy.get_priority(node)

    def freed_parent(self, node: Any, planned: Set[Any]) -> Optional[Any]:
        """``node``'s parent if evicting the planned set makes it a device leaf (upstream's
        ``_is_device_leaf`` with the planned children gone)."""
        parent = node.parent
        if parent is None or parent is self.cache.tree_core.root_node or parent.evicted:
            return None
        if any(cd.lock_ref > 0 for cd in parent.component_data):
            return None
        for child in parent.children.values():
            if self._full(child).value is not None and child not in planned:
                return None
        return parent

    def candidates(self) -> Iterator[Any]:
        """The evictable device leaves in (priority, node id) order."""
        heap = [(self.priority(n), n.id, n) for n in self.cache.tree_core.evictable_device_leaves]
        heapq.heapify(heap)
        while heap:
            yield heapq.heappop(heap)[2]

    # ------------------------------------------------------------------- making room
    def plan(self, demand: Sequence[int]) -> Optional[List[Any]]:
        """Victims that cover ``demand`` on every short lane ([] if none is short)."""
        deficit = lane_deficit(demand, self.free_pages())
        if max(deficit) <= 0:
            return []
        return plan_lane_victims(
            self.candidates(), deficit, self.lane_pages, self.freed_parent, self.priority,
            parent_of=_parent_of,
        )  # fmt: skip

    def make_room(self, demand: Sequence[int]) -> Any:
        """Evict a plan for ``demand`` (pages per lane); an uncoverable one evicts nothing
        and counts a refusal. Returns upstream's ``EvictResult``."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        victims = self.plan(demand)
        if victims is None:
            STATS.refusals += 1
            logger.debug(
                "cp_hicache: device lanes %s cannot cover %s from evictable leaves; evicting "
                "nothing", self.free_pages(), list(demand),
            )  # fmt: skip
            return EvictResult()
        if not victims:
            return EvictResult()
        return EvictResult(num_tokens_evicted=self._evict(victims))

    def make_extend_room(
        self, bases: Sequence[Optional[int]], prefix_lens: Sequence[int], seq_lens: Sequence[int]
    ) -> None:
        """Room for one extend batch's exact draws. Evicting can change which lane a new
        chain starts on (the least-full one), so the draws are re-simulated after each
        plan; every round evicts at least one node, so this ends."""
        while True:
            demand = extend_lane_demand(
                self.free_pages(), bases, prefix_lens, seq_lens, self.lanes, self.page_size
            )
            victims = self.plan(demand)
            if victims is None:
                STATS.refusals += 1
                return
            if not victims:
                return
            self._evict(victims)

    def _evict(self, victims: List[Any]) -> int:
        """Evict ``victims`` in plan order as upstream's walk evicts a leaf (demote when
        backed up, drop when not; write-back backs up first); the evicted token count."""
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        cache, start = self.cache, time.perf_counter()
        tracker = {ct: 0 for ct in cache.tree_components}
        for node in victims:
            backup_kv = cache._evict_device_leaf(node.id, tracker)
            if backup_kv is None:
                continue
            if cache._execute_and_commit_kv_backup(backup_kv, write_back=True) > 0:
                cache.writing_check(write_back=True)
                cache._demote(node.id, tracker)
            elif not cache._drop_subtree_no_host(node.id, tracker):
                logger.warning(
                    "cp_hicache write_back: node %d stays on device (backup refused, subtree "
                    "locked)", node.id,
                )  # fmt: skip
        if cache.is_write_back:
            cache.writing_check(write_back=True)
        evicted = tracker[ComponentType.FULL]
        cache.update_eviction_metrics(evicted, start)
        STATS.plans += 1
        STATS.victims += len(victims)
        STATS.evicted_tokens += evicted
        return evicted


# ------------------------------------------------------------------------- the hooks
def alloc_paged_token_slots_extend_around(
    original: Callable,
    tree_cache: Any,
    prefix_lens: Any,
    prefix_lens_cpu: Any,
    seq_lens: Any,
    seq_lens_cpu: Any,
    last_loc: Any,
    extend_num_tokens: int,
    req_pool_indices: Any = None,
    batch: Any = None,
):
    """Upstream's paged extend allocation, its eviction made lane-aware and exact."""
    call = lambda: original(  # noqa: E731
        tree_cache, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
        extend_num_tokens, req_pool_indices=req_pool_indices, batch=batch,
    )  # fmt: skip
    if batch is None or not lane_aware(tree_cache):
        return call()
    from sglang.srt.mem_cache import allocation

    prefix = [int(n) for n in prefix_lens_cpu]
    # Upstream's own reading of each chain's base (req.last_node's, None for a new chain).
    bases = allocation._kv_shard_rotation_bases(
        tree_cache=tree_cache, batch=batch, prefix_lens_cpu=prefix_lens_cpu
    )
    evictor = DeviceLaneEvictor(tree_cache, tree_cache.token_to_kv_pool_allocator)
    evictor.make_extend_room(bases, prefix, [int(n) for n in seq_lens_cpu])
    token = _extend_room_made.set(True)
    try:
        return call()
    finally:
        _extend_room_made.reset(token)


def evict_for_alloc_around(
    original: Callable,
    cache: Any,
    params: Any,
    *,
    allocation_reclaim_satisfied: Optional[Callable[[], bool]] = None,
):
    """``UnifiedRadixCache.evict_for_alloc``: lane-aware room for upstream's target."""
    if _extend_room_made.get() and lane_aware(cache):
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        return EvictResult()  # the extend's exact room is already made
    if (
        not lane_aware(cache)
        or allocation_reclaim_satisfied is not None
        or params.swa_num_tokens
        or params.mamba_num
    ):
        return original(cache, params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
    evictor = DeviceLaneEvictor(cache, cache.token_to_kv_pool_allocator)
    target = evictor.allocator.available_size() + params.num_tokens
    return evictor.make_room(evictor.floor_demand(target))


def evict_until_allocatable_around(
    original: Callable, tree_cache: Any, allocator: Any, num_tokens: int
):
    """``common._evict_until_allocatable``: skipped under lane-aware eviction, whose
    ``evict_for_alloc`` (called just before, for the same floor) made the room or refused."""
    if lane_aware(tree_cache):
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        return EvictResult()
    return original(tree_cache, allocator, num_tokens)


__all__ = [
    "DeviceLaneEvictor",
    "LaneEvictionStats",
    "STATS",
    "alloc_paged_token_slots_extend_around",
    "evict_for_alloc_around",
    "evict_until_allocatable_around",
    "lane_aware",
]
