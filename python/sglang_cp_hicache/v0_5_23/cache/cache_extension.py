"""One :class:`CpCacheExtension` per sharded ``UnifiedRadixCache``: the plugin's state for
that cache, owned in one place.

Built once, right after ``UnifiedRadixCache.__init__`` (:func:`cache_init_after`), when the
published record's mode (``cp_mode.CpMode``, frozen at resolution) shards KV and the
cache's allocator is upstream's sharded ``PageInterleavePoolAllocator``; a flag-off,
unsharded or one-prefill-rank cache gets none, and every hook of the line then calls
upstream's function unchanged: "is an extension attached?" is the only question a cache's
hook asks, and the extension carries the mode it was built under. Its HiCache side
(host lanes, the per-layer backup) is filled in once by ``init_hicache``'s AFTER hook.

It owns: the chains started per rotation base (:class:`ChainStarts`), the device and host
lane-eviction stats and candidate heaps (``core.leaf_heap.LazyLeafHeap``: persistent
across plans, over the tree core's own leaf sets), the plugin's Prometheus series
(``plugin_metrics``, with ``--enable-metrics`` only), the L3 prefetches' start owners (weakly keyed by operation: an
entry dies with its operation, whichever way it ends) and the
prefetches not issued under a pending backup, the L3 KV events between a storage write
and its ack (``core.l3_event_log``), and the per-layer backup and which pool feeds which of
its stages. Nothing of one call is kept here: a decision one hook makes and
another applies (an extend's rotation bases, a load-back's or a backup's per-lane room, the
device plan being evicted) travels with the call as a frozen value or a view of the cache
(``eviction/device_views.py``, ``host_lane_eviction.BackupRoom``). Every hook finds
it with :func:`extension_of` on the SGLang object it was handed (the cache, its tree core,
its allocator, its KV pools), which is the one lookup table of the line: identity-keyed,
weak (it dies with the cache), written only here.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.core.l3_event_log import L3EventLog
from sglang_cp_hicache.core.leaf_heap import LazyLeafHeap
from sglang_cp_hicache.v0_5_23.cache.plugin_metrics import NO_METRICS, cache_metrics
from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode

logger = logging.getLogger(__name__)

#: Where a device eviction was asked for: an extend's exact draws, a load-back's exact
#: draws, or any other caller's min-class floor.
PATHS = ("extend", "load_back", "floor")
#: Who asked for host room: upstream's backup (insert write-through, write-back demotes),
#: the per-layer backup's reservation before a forward, an L3 storage hit.
HOST_PATHS = ("backup", "layer_backup", "storage_hit")


@dataclass
class RoomStats:
    """Lane-aware room made on one tier (or one device path), in replicated counts (equal
    on every rank): calls that found the tier short (upstream would have evicted), of those
    the ones the free lanes already held (host backups only: nothing evicted), plans
    carried out, refusals (an uncoverable deficit: nothing evicted), victims and tokens
    evicted by plans."""

    short: int = 0
    fit: int = 0
    plans: int = 0
    refusals: int = 0
    victims: int = 0
    evicted_tokens: int = 0


@dataclass
class LaneEvictionStats:
    """One cache's lane-aware room on one tier, per path (device: :data:`PATHS`, host:
    :data:`HOST_PATHS`); plans and refusals also feed the tier's Prometheus series
    (``plugin_metrics.TierSeries``; none without ``--enable-metrics``)."""

    paths: Dict[str, RoomStats] = field(default_factory=lambda: {p: RoomStats() for p in PATHS})
    series: Any = NO_METRICS.device

    @classmethod
    def of(cls, paths: Sequence[str], series: Any = NO_METRICS.device) -> "LaneEvictionStats":
        return cls({path: RoomStats() for path in paths}, series)

    def planned(self, path: str, victims: int, evicted_tokens: int) -> None:
        """A plan of ``victims`` nodes carried out on ``path``, freeing ``evicted_tokens``."""
        stats = self.paths[path]
        stats.plans += 1
        stats.victims += victims
        stats.evicted_tokens += evicted_tokens
        self.series.planned(path, evicted_tokens)

    def refused(self, path: str) -> None:
        """An uncoverable deficit on ``path``: nothing evicted."""
        self.paths[path].refusals += 1
        self.series.refused(path)

    def total(self, name: str) -> int:
        return sum(getattr(stats, name) for stats in self.paths.values())


@dataclass
class ChainStarts:
    """New chains started per rotation base on one sharded allocator since it was built
    (the lane-aware extends', and root-anchored L3 reads' whose host slots were held):
    replicated (every rank runs the same extends and reads), read to spread the next new
    chain's base (``core.lane_eviction.base_overlaps``)."""

    per_base: List[int]

    def add(self, bases: Sequence[int]) -> None:
        for base in bases:
            self.per_base[base] += 1


def keys_only_grow(tree_core: Any, session_refs: bool) -> bool:
    """Whether a node's eviction key on ``tree_core`` can only grow while it is cached (a
    persistent candidate heap is then exact, ``core.leaf_heap``): the tree's strategy is
    one whose key is access times, hit counts or priorities, and (``session_refs``: the key
    leads with the node's session refs, which drop) session radix caching is off."""
    from sglang.srt.mem_cache.evict_policy import (
        FIFOStrategy, LFUStrategy, LRUStrategy, PriorityStrategy, SLRUStrategy,
    )  # fmt: skip

    growing = (LRUStrategy, LFUStrategy, FIFOStrategy, PriorityStrategy, SLRUStrategy)
    if type(tree_core.eviction_strategy) not in growing:
        return False
    return not (session_refs and tree_core.enable_session_radix_cache)


class CpCacheExtension:
    """The plugin's state for one sharded ``UnifiedRadixCache`` (one per scheduler rank).

    Invariants: built once per cache, before its first allocation, only in a mode that
    shards KV (:attr:`mode`, frozen); every field is replicated (identical on every rank)
    and outlives any one call.
    """

    def __init__(self, cache: Any, allocator: Any, mode: CpMode) -> None:
        if not mode.shards_kv:
            raise ValueError(f"a CpCacheExtension serves a sharded cache, not mode {mode.value}")
        self.mode = mode
        self.cache = cache
        self.allocator = allocator  # PageInterleavePoolAllocator
        self.chain_starts = ChainStarts([0] * allocator.shard_size)
        # The plugin's Prometheus series: only where upstream built the cache's collector.
        self.metrics = cache_metrics(cache, allocator.page_size)
        self.device_stats = LaneEvictionStats.of(PATHS, self.metrics.device)
        self.host_stats = LaneEvictionStats.of(HOST_PATHS, self.metrics.host)
        # The lane planners' candidates, in (priority, node id) order: the device tier
        # keys by the tree's strategy, the host tier by FULL's session-ref key.
        self.device_leaves = LazyLeafHeap(keys_only_grow(cache.tree_core, session_refs=False))
        self.host_leaves = LazyLeafHeap(keys_only_grow(cache.tree_core, session_refs=True))
        # HiCache (init_hicache's AFTER hook): the KV host pool is the sharded one.
        self.host_lanes = False
        self.layer_backup: Optional[Any] = None  # layer_backup.CacheLayerBackup
        self._pool_listeners: List[Tuple[Any, Any]] = []  # (device pool, its backup stage)
        # L3: each prefetch operation's first page's owner (None: a root anchor, resolved
        # at allocation), recorded when the cache issues it; prefetches not issued.
        self.start_owners: "weakref.WeakKeyDictionary[Any, Optional[int]]" = (
            weakref.WeakKeyDictionary()
        )
        self.anchor_skips = 0
        # L3 KV events on the publisher rank: storage writes' events held until their ack,
        # the blocks published as stored on the tier (storage/l3_events.py).
        self.l3_events: L3EventLog = L3EventLog()

    # ---------------------------------------------------------------- the layer backup
    def attach_layer_backup(self, backup: Any, listeners: Sequence[Tuple[Any, Any]]) -> None:
        """Give the cache its per-layer backup; ``listeners``: (device pool, the stage its
        KV stores feed), each pool findable by :func:`extension_of`."""
        self.layer_backup = backup
        for pool, listener in listeners:
            self._pool_listeners.append((pool, listener))
            _register(pool, self)

    def listener_of(self, device_pool: Any) -> Optional[Any]:
        """The backup stage ``device_pool``'s KV stores feed, None when it feeds none."""
        for pool, listener in self._pool_listeners:
            if pool is device_pool:
                return listener
        return None


# ---------------------------------------------------------------------- the lookup
_EXTENSIONS: "weakref.WeakKeyDictionary[Any, CpCacheExtension]" = weakref.WeakKeyDictionary()


def _register(obj: Any, extension: CpCacheExtension) -> None:
    _EXTENSIONS[obj] = extension


def extension_of(obj: Any) -> Optional[CpCacheExtension]:
    """The extension of the cache ``obj`` is (or whose tree core, allocator or KV pool it
    is); None when it has none, or ``obj`` cannot be one (not weak-referenceable)."""
    try:
        return _EXTENSIONS.get(obj)
    except TypeError:
        return None


def host_extension_of(cache: Any) -> Optional[CpCacheExtension]:
    """``cache``'s extension when its KV host pool is the sharded one (decided once, at
    ``init_hicache``): the backups' host room and the L3 owner storage apply."""
    extension = extension_of(cache)
    return extension if extension is not None and extension.host_lanes else None


def _is_sharded_allocator(allocator: Any) -> bool:
    from sglang.srt.mem_cache.allocator.page_interleave import PageInterleavePoolAllocator

    return isinstance(allocator, PageInterleavePoolAllocator) and allocator.shard_size > 1


# --------------------------------------------------------------------------- hooks
def cache_init_after(result: Any, cache: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``UnifiedRadixCache.__init__``: an extension for this cache when the published
    record's mode (frozen at resolution) shards KV over the sharded allocator."""
    from sglang.srt.runtime_context import get_server_args

    allocator = cache.token_to_kv_pool_allocator
    if not _is_sharded_allocator(allocator):
        return
    mode = cp_mode(get_server_args())
    if not mode.shards_kv:
        return
    extension = CpCacheExtension(cache, allocator, mode)
    for obj in (cache, cache.tree_core, allocator):
        _register(obj, extension)


def decide_host_side(cache: Any) -> None:
    """Once ``init_hicache`` built the controller: whether the KV host pool is upstream's
    sharded one (the backups' host room and the L3 owner storage apply)."""
    from sglang.srt.mem_cache.pool_host.page_interleave import PageInterleaveHostPool

    extension = extension_of(cache)
    if extension is not None and cache.cache_controller is not None:
        host_pool = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
        extension.host_lanes = isinstance(host_pool, PageInterleaveHostPool)


__all__ = [
    "ChainStarts",
    "CpCacheExtension",
    "HOST_PATHS",
    "LaneEvictionStats",
    "PATHS",
    "RoomStats",
    "cache_init_after",
    "extension_of",
    "decide_host_side",
    "host_extension_of",
    "keys_only_grow",
]
