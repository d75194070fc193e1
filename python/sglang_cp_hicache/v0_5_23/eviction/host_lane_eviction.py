"""Lane-aware host eviction for backups on SGLang 0.5.23's native KV sharding.

Upstream's backup (``UnifiedRadixCache._execute_kv_backup``) gates on the host pool's
min-class floor (``PageInterleaveHostPool.available_size``: the tightest owner lane x N)
and, when the floor is below the backup's tokens, evicts host leaves by LRU until the
missing *tokens* are freed, else skips the backup. The host slots it then takes are
owner-matched (``alloc_cyclic`` from the node's rotation phase), so what the backup
really needs is known per lane. Counting tokens evicts for room other lanes already
have, and can skip a backup the lanes could hold once the right lane is freed.

Under the plugin's flag, inside a backup, the host room is the backup's exact per-lane
draws and is made by the shared planner
(:func:`sglang_cp_hicache.core.lane_eviction.plan_lane_victims`): host leaves in (priority,
node id) order that free pages on a short lane only (an inner host node is reached through
its leaves in the LRU walk's own turn), stopping once every short lane is covered. A
backup the free lanes hold evicts nothing; an uncoverable deficit evicts nothing and is a
counted refusal, and the backup is skipped as upstream skips it.

The backup's room travels as an explicit value, :class:`BackupRoom` (its first host page's
owner lane and its pages), handed to ``UnifiedRadixCache.evict_host`` as the keyword
``backup_room`` that :func:`evict_host_around` (AROUND ``evict_host``) takes off: inside it,
for FULL KV, the lane-aware room; it answers upstream's ``evict_host(needed) < needed`` test
with ``needed`` when the lanes hold the backup (made or already there) and 0 when they
cannot be made to. ``evict_host`` without it is upstream's walk. Who hands it over:

* upstream's backup (``UnifiedRadixCache._execute_kv_backup``, every backup: insert
  write-through, write-back demotes): :func:`backup_with_lane_room` runs upstream's body
  over a view of the cache whose ``evict_host`` carries the node's room (its rotation phase,
  the pages of the device value it backs up), when the host floor is short (else upstream's
  body runs as is and never evicts);
* a caller that reserves host slots itself (the per-layer backup's reservation before the
  forward, an L3 storage hit): :func:`room_for_backup` and :func:`evict_host_for_backup`.

Every decision reads replicated state only (the logical tree, node ids, rotation phases,
the logical host slot allocator's per-lane free counts, identical on every rank since
every rank makes the same allocations and frees): every rank evicts the same nodes, no
collective. The counts are the cache's extension's.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterator, List, Optional, Sequence, Set

from sglang_cp_hicache.core.field_overlay import FieldOverlay
from sglang_cp_hicache.core.lane_eviction import lane_deficit
from sglang_cp_hicache.core.rotation import lane_page_counts, run_lane_counts
from sglang_cp_hicache.v0_5_23.cache.cache_extension import CpCacheExtension, host_extension_of
from sglang_cp_hicache.v0_5_23.eviction.lane_tier import (
    Priority,
    full_type,
    plan_tier_victims,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackupRoom:
    """What one backup draws from the host: ``pages`` host pages, a cyclic run of owner
    lanes from ``start_owner`` (the lane of its first host page: ``alloc_cyclic`` from the
    node's rotation phase); ``path``: who asks (``cache_extension.HOST_PATHS``, where its
    counts go)."""

    start_owner: int
    pages: int
    path: str = "backup"

    def demand(self, lanes: int) -> List[int]:
        """Host pages per owner lane."""
        return run_lane_counts(self.start_owner, self.pages, lanes)


@dataclass
class HostLaneEvictor:
    """Makes per-lane host room on one ``UnifiedRadixCache`` (Python tree core) whose KV
    anchor host pool is a ``PageInterleaveHostPool``. Demands and free counts are pages per
    owner lane of the logical host slot space (lane = logical host page % N). Its counts
    are its cache's extension's."""

    extension: CpCacheExtension

    def __post_init__(self) -> None:
        self.cache = self.extension.cache  # UnifiedRadixCache

    @property
    def host_pool(self) -> Any:  # PageInterleaveHostPool
        return self.cache.cache_controller.mem_pool_host.anchor_entry.host_pool

    @property
    def lanes(self) -> int:
        return self.host_pool.shard_size

    @property
    def page_size(self) -> int:
        return self.host_pool.page_size

    def free_pages(self) -> List[int]:
        """Free host pages per owner lane: the logical slot allocator's, replicated."""
        return self.host_pool._slots.class_free_page_counts()

    # ----------------------------------------------------------------- the planner's view
    def lane_pages(self, node: Any) -> List[int]:
        """``node``'s host pages per owner lane, read off its logical host slots (CPU
        indices: no device sync)."""
        host_value = node.component_data[full_type()].host_value
        logical_pages = (host_value[:: self.page_size] // self.page_size).tolist()
        return lane_page_counts(logical_pages, self.lanes)

    def _component(self) -> Any:
        component = self.cache.tree_core.components_by_type[full_type()]
        component._ensure_eviction_strategy()
        return component

    def candidates(self, priority: Priority) -> Iterator[Any]:
        """The evictable host leaves in (priority, node id) order (the extension's
        persistent heap over the tree core's leaf set)."""
        return self.extension.host_leaves.candidates(
            self.cache.tree_core.evictable_host_leaves, priority
        )

    def freed_parent(self, node: Any, planned: Set[Any]) -> Optional[Any]:
        """``node``'s parent if evicting the planned set makes it a host leaf (upstream's
        ``_is_host_leaf`` with the planned children gone)."""
        parent = node.parent
        if parent is None or parent is self.cache.tree_core.root_node:
            return None
        if not parent.evicted or not parent.backuped:
            return None
        if any(cd.host_lock_ref > 0 or cd.lock_ref > 0 for cd in parent.component_data):
            return None
        if any(child not in planned for child in parent.children.values()):
            return None
        return parent

    # ------------------------------------------------------------------- making room
    def make_room(self, demand: Sequence[int], path: str = "backup") -> bool:
        """Evict a plan covering ``demand`` (pages per lane) on every short lane; False
        (nothing evicted, a refusal counted on ``path``) when the short lanes cannot be
        covered."""
        free, room = self.free_pages(), self.extension.host_stats
        stats = room.paths[path]
        stats.short += 1
        deficit = lane_deficit(demand, free)
        if max(deficit) <= 0:
            stats.fit += 1
            return True
        priority = self._component().session_ref_eviction_strategy
        victims = plan_tier_victims(self, deficit, priority)
        if victims is None:
            room.refused(path)
            logger.debug(
                "cp_hicache backup: host lanes %s cannot cover %s from evictable host "
                "leaves; evicting nothing", free, list(demand),
            )  # fmt: skip
            return False
        logger.debug(
            "cp_hicache backup: host lanes %s, demand %s: victims %s",
            free, list(demand), [n.id for n in victims],
        )  # fmt: skip
        self._evict(victims, path)
        return True

    def _evict(self, victims: List[Any], path: str) -> None:
        """Evict ``victims`` in plan order as upstream's host walk evicts a leaf."""
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import (
            DriveHostEvictionResult,
        )

        tree_core = self.cache.tree_core
        result = DriveHostEvictionResult()
        for node in victims:
            tree_core._evict_host_leaf(
                node, result.tracker, result.device_frees, result.host_frees,
                cache_actions=result.cache_actions,
            )  # fmt: skip
        evicted = result.tracker.get(full_type(), 0)
        self.cache._apply_eviction_result(result)
        self.extension.host_stats.planned(path, len(victims), evicted)


def room_for_backup(
    cache: Any, start_owner: Optional[int], num_tokens: int, path: str = "backup"
) -> Optional[BackupRoom]:
    """The lane-aware room a backup of ``num_tokens`` (page-aligned) logical tokens whose
    host slots start on owner lane ``start_owner`` asks ``evict_host`` for (``path``: who
    asks); None where upstream's walk applies (no sharded host pool, no owner, nothing to
    copy)."""
    if start_owner is None or not num_tokens or host_extension_of(cache) is None:
        return None
    return BackupRoom(int(start_owner), num_tokens // cache.page_size, path)


def evict_host_for_backup(evict_host: Callable[..., int], room: Optional[BackupRoom], needed: int) -> int:
    """``evict_host(needed)`` (a cache's bound ``evict_host``) with the backup's lane room
    when it has one."""
    return evict_host(needed) if room is None else evict_host(needed, backup_room=room)


def backup_with_lane_room(
    original: Callable, cache: Any, node_id: Any, device_value: Any, *args: Any
) -> Any:
    """Upstream's ``_execute_kv_backup`` (``original``) of ``node_id``; when its host floor
    is short under the sharded host pool, run over a view of ``cache`` whose ``evict_host``
    carries the node's :class:`BackupRoom` (so its eviction is the backup's exact lane
    room). The floor is upstream's own test, read once more here."""
    num_tokens = len(device_value)
    if (
        not num_tokens
        or host_extension_of(cache) is None
        or cache.host_memory_mode == "buffer_only"
        or cache.cache_controller.mem_pool_host.available_size() >= num_tokens
    ):
        return original(cache, node_id, device_value, *args)
    room = room_for_backup(cache, cache.tree_core.rotation_phase_of(node_id), num_tokens)
    if room is None:
        return original(cache, node_id, device_value, *args)
    with_room = FieldOverlay(
        cache, {"evict_host": lambda evict_host: functools.partial(evict_host, backup_room=room)}
    )
    return original(with_room, node_id, device_value, *args)


# ------------------------------------------------------------------------- the hook
def evict_host_around(
    original: Callable,
    cache: Any,
    num_tokens: int,
    *args: Any,
    backup_room: Optional[BackupRoom] = None,
    **kwargs: Any,
) -> int:
    """``UnifiedRadixCache.evict_host``: given a backup's room (``backup_room``), for FULL
    KV, its exact per-lane room: ``num_tokens`` when the lanes hold it (made or already
    there), 0 when they cannot be made to (nothing evicted). Otherwise: upstream's walk."""
    extension = None if backup_room is None else host_extension_of(cache)
    component_type = args[0] if args else kwargs.get("component_type", full_type())
    if (
        extension is None
        or not backup_room.pages
        or component_type != full_type()
        or cache.host_memory_mode == "buffer_only"
    ):
        return original(cache, num_tokens, *args, **kwargs)
    evictor = HostLaneEvictor(extension)
    return num_tokens if evictor.make_room(backup_room.demand(evictor.lanes), backup_room.path) else 0


__all__ = [
    "BackupRoom",
    "HostLaneEvictor",
    "backup_with_lane_room",
    "evict_host_around",
    "evict_host_for_backup",
    "room_for_backup",
]
