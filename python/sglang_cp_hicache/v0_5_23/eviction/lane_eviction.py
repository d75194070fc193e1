"""Lane-aware device eviction on SGLang 0.5.23's native KV sharding.

Upstream's sharded allocator admits on the tightest owner lane (``available_size`` = the
min-class floor x N), and its device eviction repeats a plain LRU ``evict`` until that floor
is met (``mem_cache/common.py:292-320``, after ``evict_for_alloc``'s LRU walk,
``allocator/base.py:155-170``): it flushes cache on lanes that were never short. Under
the plugin's flag, room is made instead by the shared planner
(:func:`sglang_cp_hicache.core.lane_eviction.plan_lane_victims`): victims in (priority,
node id) order that hold pages on a short lane only, stopping once every short lane is
covered; an uncoverable deficit evicts nothing and is a counted refusal. Pages on a short
lane held by an inner node are reached through the leaves below it in the LRU walk's own
turn (the planner's ``parent_of``), and only the leaves needed to free it go: planning
leaves alone would keep a dead chain's old ancestors and evict a younger leaf on the short
lane instead, which in the simulator cost more device hits (hence more evictions) than
upstream's lane-blind flushes saved.

Six hooks (the eviction room's ``HOOKS``), each upstream's function unchanged for a cache without a
``CpCacheExtension`` (flag off, or not the sharded allocator: ``cache_extension.py``). Each
decision is a frozen value handed to where it applies, never left on the extension: upstream's
own function runs over a view of the cache (``core.field_overlay.FieldOverlay``) that carries
it, or it rides in upstream's own parameter object.

* ``allocation:alloc_paged_token_slots_extend`` (AROUND) with
  ``allocation:_kv_shard_rotation_bases`` (AROUND): the extend's exact per-lane draws (the
  allocator's own rule: ``(b_i + P) % N`` per position-page) are made room for, then
  upstream's function runs over an :class:`ExtendRoom` view of the cache: its own
  conservative (one page per lane per request) eviction finds nothing to do, and the
  allocator draws at the bases the room was made for (the view's, read by the bases hook
  off its ``tree_cache`` argument). A batch of continuing chains whose draws every lane
  holds at any rotation (:func:`fits_any_rotation`) needs neither room nor new bases: it
  runs over the view at once, with upstream's own bases. A new
  chain starts on a lane from which its draws fit the free pages at its turn (upstream:
  the freest lane, fitting or not), so an extend the free lanes can hold at some rotation
  evicts nothing; among those, the one overlapping least the chains started before
  (``ChainStarts``, :func:`~sglang_cp_hicache.core.lane_eviction.base_overlaps`), then the
  freest. Every request that continues a chain lays its odd pages on the lanes right
  after the chain's base, and upstream's ties to the lowest lane start the hot chains
  together: those lanes back up, store and send more (``docs/pd_transfer.md``). A new
  chain whose prompt starts with the same page as an earlier request's of the batch
  takes that request's base instead (upstream: its own
  least-full lane, and the later insert over the shared prefix is refused as a join of
  two rotation runs, ``unified_tree_core.py:1158-1229``, so the request's KV is not
  cached). A refusal leaves the allocator short and upstream's "Prefill out of memory"
  stands, as when upstream's eviction runs dry.
* ``UnifiedRadixCache._load_back_transfers`` (AROUND): a load-back's room is its exact
  per-owner demand. Host slots are owner-matched (the load keeps its host pages' owners,
  ``alloc_cyclic`` from the first page), so the pages it draws per lane are known once the
  tree core has built the transfer. Upstream's body runs over a :class:`_LoadBackView` of
  the cache: its tree core's ``build_load_back_spec`` records the draws (the call's own
  :class:`LoadDemand`); upstream's gate (the min-class floor reaching the load's tokens,
  up to one page per lane more than the load draws) is answered for them
  (``_component_available_size``), and its ``evict_for_alloc`` asks for them
  (:class:`LaneDemandParams`). A refusal leaves the gate short, which upstream answers by
  skipping the load (the request recomputes), as when upstream's walk runs dry.
* ``UnifiedRadixCache.evict_for_alloc`` (AROUND): a load-back's exact room
  (:class:`LaneDemandParams`), or any other caller's room for upstream's own target, the
  min-class floor reaching ``available + num_tokens``.
* A plan is evicted by upstream's own device walk (``UnifiedRadixCache._evict``, its step
  results, write-back backups, writing check and metrics) run over a view of the cache
  whose FULL walk's node source is the plan (:func:`_planned_walk`): the walk's heap of
  every evictable leaf is then not built.
* ``common:_evict_until_allocatable`` (AROUND): its only caller
  (``BaseTokenToKVPoolAllocator.evict_to_free_tokens``) has just called the lane-aware
  ``evict_for_alloc`` for the same floor, so its extra plain-LRU passes are skipped.

Every decision reads replicated state only (the logical tree, node ids, rotation phases,
the mirrored lane free counts): every rank evicts the same nodes, no collective. The
counts and the chains started are the cache's extension's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set

from sglang_cp_hicache.core.lane_eviction import (
    extend_lane_demand,
    first_page_leaders,
    lane_deficit,
)
from sglang_cp_hicache.core.rotation import run_lane_counts
from sglang_cp_hicache.v0_5_23.eviction.lane_tier import (
    Priority,
    full_type,
    plan_tier_victims,
)
from sglang_cp_hicache.v0_5_23.cache.cache_extension import CpCacheExtension, extension_of
from sglang_cp_hicache.v0_5_23.eviction.device_views import (
    ExtendRoom,
    LaneDemandParams,
    LoadDemand,
    load_back_view,
    planned_walk,
)

logger = logging.getLogger(__name__)


@dataclass
class DeviceLaneEvictor:
    """Makes per-lane device room on one ``UnifiedRadixCache`` (Python tree core) over a
    ``PageInterleavePoolAllocator``. Demands and free counts are in pages per owner lane.

    A node's pages per lane come from its rotation phase (host metadata upstream keeps for
    the same reason: reading the device locs would sync the stream); its FULL value is
    page-aligned and its owners one cyclic run (upstream refuses inserts that join runs).
    Its counts and the chains it starts are its cache's extension's.
    """

    extension: CpCacheExtension

    def __post_init__(self) -> None:
        self.cache = self.extension.cache  # UnifiedRadixCache
        self.allocator = self.extension.allocator  # PageInterleavePoolAllocator

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
    # Runs per candidate and per planned victim: the component type is imported once (an
    # in-function import costs microseconds) and the key is the strategy's bound
    # ``get_priority`` (no wrapper frame per evictable leaf).
    def lane_pages(self, node: Any) -> List[int]:
        phase = self.cache.tree_core.rotation_phase_of(node.id)
        if phase is None:
            raise RuntimeError(
                f"cp_hicache lane eviction: device node {node.id} has no rotation base under "
                "KV sharding; its pages' owner lanes are unknown"
            )
        pages = len(node.component_data[full_type()].value) // self.allocator.page_size
        return run_lane_counts(phase, pages, self.allocator.shard_size)

    @property
    def priority(self) -> Priority:
        """The tree's eviction key of a node (the strategy's bound ``get_priority``)."""
        return self.cache.tree_core.eviction_strategy.get_priority

    def freed_parent(self, node: Any, planned: Set[Any]) -> Optional[Any]:
        """``node``'s parent if evicting the planned set makes it a device leaf (upstream's
        ``_is_device_leaf`` with the planned children gone)."""
        parent = node.parent
        if parent is None or parent is self.cache.tree_core.root_node or parent.evicted:
            return None
        for cd in parent.component_data:
            if cd.lock_ref > 0:
                return None
        full = full_type()
        for child in parent.children.values():
            if child.component_data[full].value is not None and child not in planned:
                return None
        return parent

    def candidates(self, priority: Priority) -> Iterator[Any]:
        """The evictable device leaves in (priority, node id) order (the extension's
        persistent heap over the tree core's leaf set)."""
        return self.extension.device_leaves.candidates(
            self.cache.tree_core.evictable_device_leaves, priority
        )

    # ------------------------------------------------------------------- making room
    def plan(self, demand: Sequence[int]) -> Optional[List[Any]]:
        """Victims that cover ``demand`` on every short lane ([] if none is short)."""
        deficit = lane_deficit(demand, self.free_pages())
        if max(deficit) <= 0:
            return []
        return plan_tier_victims(self, deficit, self.priority)

    def make_room(self, demand: Sequence[int], path: str) -> Any:
        """Evict a plan for ``demand`` (pages per lane); an uncoverable one evicts nothing
        and counts a refusal. Returns upstream's ``EvictResult``."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        victims = self._plan_or_refuse(demand, path)
        if not victims:
            return EvictResult()
        return EvictResult(num_tokens_evicted=self._evict(victims, path))

    def make_extend_room(
        self,
        bases: Sequence[Optional[int]],
        prefix_lens: Sequence[int],
        seq_lens: Sequence[int],
        leaders: Optional[Sequence[Optional[int]]] = None,
    ) -> List[int]:
        """Room for one extend batch's exact draws; the rotation bases the room was made
        for (new chains resolved fit-first, spread from the chains started before, or at
        their ``leaders``' bases: :func:`extend_lane_demand`). Each round asks upstream's
        ``evict_for_alloc`` for the draws (:class:`LaneDemandParams`: this evictor's
        :meth:`make_room`). Evicting changes the free lanes a new chain is placed by, so
        the draws are re-simulated after each plan; every round that evicts evicts at
        least one node, so this ends."""
        started = self.extension.chain_starts.per_base
        while True:
            free = self.free_pages()
            demand, resolved = extend_lane_demand(
                free, bases, prefix_lens, seq_lens, self.lanes, self.page_size,
                fit_first=True, leaders=leaders, chain_starts=started,
            )  # fmt: skip
            if max(lane_deficit(demand, free)) <= 0:
                return resolved
            params = LaneDemandParams(
                num_tokens=sum(demand) * self.page_size, lane_demand=tuple(demand), path="extend"
            )
            if not self.cache.evict_for_alloc(params).num_tokens_evicted:
                return resolved

    def _plan_or_refuse(self, demand: Sequence[int], path: str) -> Optional[List[Any]]:
        """A plan for ``demand``; None (counted, logged) when the short lanes cannot be
        covered, [] when no lane is short."""
        free = self.free_pages()
        if max(lane_deficit(demand, free)) <= 0:
            return []
        self.extension.device_stats.paths[path].short += 1
        victims = self.plan(demand)
        if victims is None:
            self.extension.device_stats.refused(path)
            logger.debug(
                "cp_hicache %s: device lanes %s cannot cover %s from evictable leaves; "
                "evicting nothing", path, free, list(demand),
            )  # fmt: skip
        elif logger.isEnabledFor(logging.DEBUG):  # its arguments cost a lane count per victim
            logger.debug(
                "cp_hicache %s: device lanes %s, demand %s: victims %s freeing %s",
                path, free, list(demand), [n.id for n in victims],
                [sum(c) for c in zip(*map(self.lane_pages, victims))],
            )  # fmt: skip
        return victims

    def _evict(self, victims: List[Any], path: str) -> int:
        """Evict ``victims`` in plan order through upstream's own device walk
        (``UnifiedRadixCache._evict``: each leaf demoted when backed up, dropped when not,
        write-back backing up first; its result objects, writing check and metrics), run
        over a view of the cache whose node source is the plan
        (``device_views.planned_walk``); the evicted token count."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        full = full_type()
        tokens = sum(len(node.component_data[full].value) for node in victims)
        walk = planned_walk(self.cache, victims)
        evicted = type(self.cache)._evict(walk, EvictParams(num_tokens=tokens)).num_tokens_evicted
        self.extension.device_stats.planned(path, len(victims), evicted)
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
    """Upstream's paged extend allocation, its eviction made lane-aware and exact: run over
    an :class:`ExtendRoom` view once the room for its draws is made."""
    extension = extension_of(tree_cache)
    if batch is None or extension is None:
        return original(
            tree_cache, prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu, last_loc,
            extend_num_tokens, req_pool_indices=req_pool_indices, batch=batch,
        )  # fmt: skip
    from sglang.srt.mem_cache import allocation

    prefix, seq = prefix_lens_cpu.tolist(), seq_lens_cpu.tolist()  # one call, not one per element
    if 0 not in prefix and fits_any_rotation(extension.allocator, prefix, seq):
        return original(  # no room to make; upstream's own bases (a cached prefix has one)
            ExtendRoom(tree_cache, None), prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
            last_loc, extend_num_tokens, req_pool_indices=req_pool_indices, batch=batch,
        )  # fmt: skip
    # Upstream's own reading of each chain's base (req.last_node's, None for a new chain).
    bases = allocation._kv_shard_rotation_bases(
        tree_cache=tree_cache, batch=batch, prefix_lens_cpu=prefix_lens_cpu
    )
    evictor = DeviceLaneEvictor(extension)
    new_chains = None in bases
    leaders = None
    if new_chains:  # only a new chain can follow a batch-mate's base
        leaders = first_page_leaders([_first_page_key(req, evictor.page_size) for req in batch.reqs])
    resolved = evictor.make_extend_room(bases, prefix, seq, leaders)
    out = original(
        ExtendRoom(tree_cache, resolved), prefix_lens, prefix_lens_cpu, seq_lens, seq_lens_cpu,
        last_loc, extend_num_tokens, req_pool_indices=req_pool_indices, batch=batch,
    )  # fmt: skip
    if new_chains:  # upstream raised if the batch drew nothing: count the chains it started
        started = list(zip(resolved, bases, leaders))
        extension.chain_starts.add(
            [base for base, given, leader in started if given is None and leader is None]
        )
        extension.metrics.kept_on_run(
            sum(1 for _, given, leader in started if given is None and leader is not None)
        )
    return out


def fits_any_rotation(allocator: Any, prefix_lens: Sequence[int], seq_lens: Sequence[int]) -> bool:
    """Whether every lane of ``allocator`` holds the batch's draws whatever its chains'
    bases: a cyclic run of ``k`` pages takes at most ``ceil(k / N)`` from one lane. A bound
    from one read of the free pages: a batch of continuing chains the lanes clearly hold
    needs neither the per-lane simulation nor any eviction (its exact draws would find no
    lane short), and keeps the bases upstream reads (SGLang's rule: a request with a cached
    prefix continues its chain, only one without starts a new one)."""
    lanes, page = allocator.shard_size, allocator.page_size
    most = sum(
        -(-(-(-seq // page) - prefix // page) // lanes) for prefix, seq in zip(prefix_lens, seq_lens)
    )
    return most <= min(allocator.class_free_page_counts())


def _first_page_key(req: Any, page_size: int) -> Optional[tuple]:
    """What decides whether two requests' insert keys share a first page (a tree path):
    the key's namespace and its first page of prompt tokens (None under a page). The
    bigram view of an EAGLE tree reads one token more; equal pages here only over-group,
    which costs a chain its own placement, never an insert."""
    tokens = req.origin_input_ids
    if len(tokens) < page_size:
        return None
    return (req.extra_key, req.cache_salt, tuple(tokens[:page_size]))


def kv_shard_rotation_bases_around(original: Callable, *args: Any, **kwargs: Any) -> list:
    """``allocation._kv_shard_rotation_bases``: inside a lane-aware extend (its
    ``tree_cache`` is the :class:`ExtendRoom` view), the bases its room was made for (a new
    list: the allocator resolves its entries in place)."""
    room = kwargs.get("tree_cache")
    if isinstance(room, ExtendRoom) and room.bases is not None:
        return list(room.bases)
    return original(*args, **kwargs)


def evict_for_alloc_around(
    original: Callable,
    cache: Any,
    params: Any,
    *,
    allocation_reclaim_satisfied: Optional[Callable[[], bool]] = None,
):
    """``UnifiedRadixCache.evict_for_alloc``: lane-aware room for a load-back's exact draws
    (:class:`LaneDemandParams`) or for upstream's target."""
    extension = extension_of(cache)
    if (
        extension is None
        or allocation_reclaim_satisfied is not None
        or params.swa_num_tokens
        or params.mamba_num
    ):
        return original(cache, params, allocation_reclaim_satisfied=allocation_reclaim_satisfied)
    evictor = DeviceLaneEvictor(extension)
    if isinstance(params, LaneDemandParams):
        return evictor.make_room(params.lane_demand, params.path)
    target = evictor.allocator.available_size() + params.num_tokens
    return evictor.make_room(evictor.floor_demand(target), "floor")


def load_back_transfers_around(original: Callable, cache: Any, **kwargs: Any):
    """``UnifiedRadixCache._load_back_transfers``: run over a view whose room and gate are
    the load-back's exact per-lane draws (``device_views.load_back_view``)."""
    extension = extension_of(cache)
    if extension is None:
        return original(cache, **kwargs)
    return original(load_back_view(cache, LoadDemand(extension.allocator)), **kwargs)


def evict_until_allocatable_around(
    original: Callable, tree_cache: Any, allocator: Any, num_tokens: int
):
    """``common._evict_until_allocatable``: skipped under lane-aware eviction, whose
    ``evict_for_alloc`` (called just before, for the same floor) made the room or refused."""
    if extension_of(tree_cache) is not None:
        from sglang.srt.mem_cache.base_prefix_cache import EvictResult

        return EvictResult()
    return original(tree_cache, allocator, num_tokens)


__all__ = [
    "DeviceLaneEvictor",
    "alloc_paged_token_slots_extend_around",
    "evict_for_alloc_around",
    "fits_any_rotation",
    "kv_shard_rotation_bases_around",
    "load_back_transfers_around",
    "evict_until_allocatable_around",
]
