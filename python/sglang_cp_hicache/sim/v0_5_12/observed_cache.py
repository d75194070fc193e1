"""The simulator's view into a rank's cache: subclasses that observe, never decide.

The product's own seams are the observation points: SGLang's KV-cache event calls
(``_record_store_event`` / ``_record_remove_event``, made on every device eviction, host
eviction, landed backup and load-back, whether or not events are published), ``evict``
(timed as its own scheduler op) and ``writing_check`` (the one place a MIN all-reduce is
allowed). Each override calls the product's method unchanged, before or after counting.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, ContextManager, Optional

from sglang.srt.mem_cache.hiradix_cache import StorageMedium

from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64
from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import UPSTREAM
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.sim.results import RankCounters


@dataclass
class CacheObserver:
    """Where one rank's observations go (set on the cache by the driver)."""

    counters: RankCounters
    timed_op: Callable[[str], ContextManager]  # the driver's timer of scheduler ops
    allowed_collective: Callable[[], ContextManager]  # marks writing_check's all-reduce
    # Tokens this rank moves for a node backed up at these logical host locs.
    physical_tokens: Callable[[Any], int]
    d2h_tokens: int = 0
    h2d_tokens: int = 0


class ObservedCacheMixin:
    """Counts evictions and transfers; ``observer`` is None until the driver sets it."""

    observer: Optional[CacheObserver] = None

    def _record_store_event(self, node, medium=None):
        observer = self.observer
        if observer is not None:
            counters = observer.counters
            if medium == StorageMedium.CPU:  # a backup landed on host
                counters.logical_written_tokens += len(node.host_value)
                observer.d2h_tokens += observer.physical_tokens(node.host_value)
            elif node.host_value is not None:  # a load-back: device again, from host
                counters.logical_loaded_tokens += len(node.host_value)
                observer.h2d_tokens += observer.physical_tokens(node.host_value)
        return super()._record_store_event(node, medium=medium)

    def _record_remove_event(self, node, medium=None):
        observer = self.observer
        if observer is not None:
            counters = observer.counters
            if medium == StorageMedium.CPU:
                counters.host_evicted_nodes += 1
                counters.host_evicted_tokens += len(node.host_value)
            else:  # demoted to host-only, or dropped (never backed up)
                counters.device_evicted_nodes += 1
                counters.device_evicted_tokens += len(node.value)
                if not node.backuped:
                    counters.device_dropped_tokens += len(node.value)
        return super()._record_remove_event(node, medium=medium)

    def evict(self, params):
        timer = self.observer.timed_op("evict") if self.observer else contextlib.nullcontext()
        with timer:
            return super().evict(params)

    def writing_check(self, *args, **kwargs):
        allowed = self.observer.allowed_collective() if self.observer else contextlib.nullcontext()
        with allowed:
            return super().writing_check(*args, **kwargs)


class ObservedCpHiRadixCache(ObservedCacheMixin, CpHiRadixCache):
    """One CP rank's cache as the plugin builds it, observed."""

    def owned_host_tokens(self, host_value) -> int:
        lane_pages = self.host_table.lane_pages(host_int64(host_value))
        return int(lane_pages[self.layout.cp_rank]) * self.page_size


class ObservedUpstreamHiRadixCache(ObservedCacheMixin, UPSTREAM["HiRadixCache"]):
    """SGLang's HiRadixCache as shipped (the cp 1 baseline), observed."""

    def owned_host_tokens(self, host_value) -> int:
        return len(host_value)  # one rank moves every token of a node
