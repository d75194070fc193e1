"""A backup's host room travels with the call (``host_lane_eviction.BackupRoom``): upstream's
backup body runs over a view whose ``evict_host`` carries the node's room only when the host
floor is short, and the node's start owner is read off it only then (a rotation phase walks
the node's whole path, and most backups find host room)."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, List, Optional

import pytest

PAGE = 64


class _TreeCore:
    """Counts the phase reads (what ``UnifiedTreeCore.rotation_phase_of`` costs a walk)."""

    def __init__(self, phase: Optional[int]) -> None:
        self.phase, self.reads = phase, 0

    def rotation_phase_of(self, node_id: Any) -> Optional[int]:
        self.reads += 1
        return self.phase


class _Cache:
    """What the backup's room reads of a ``UnifiedRadixCache``; ``evict_host`` records what
    it was asked."""

    page_size = PAGE
    host_memory_mode = "cache"

    def __init__(self, phase: Optional[int], host_free_tokens: int) -> None:
        self.tree_core = _TreeCore(phase)
        pool = SimpleNamespace(available_size=lambda: host_free_tokens)
        self.cache_controller = SimpleNamespace(mem_pool_host=pool)
        self.asked: List[tuple] = []

    def evict_host(self, num_tokens: int, *args: Any, **kwargs: Any) -> int:
        self.asked.append((num_tokens, kwargs.get("backup_room")))
        return num_tokens


@pytest.fixture
def lane_aware():
    """A cache whose extension says its host pool is the sharded one."""
    from sglang_cp_hicache.v0_5_23.cache import cache_extension

    def make(phase: Optional[int], host_free_tokens: int) -> _Cache:
        cache = _Cache(phase, host_free_tokens)
        cache_extension._register(cache, SimpleNamespace(host_lanes=True))
        return cache

    return make


def _upstream_body(cache: Any, node_id: Any, device_value: Any, *rest: Any) -> str:
    """Upstream's ``_execute_kv_backup`` as far as the room goes: short floor, evict."""
    needed = len(device_value) - cache.cache_controller.mem_pool_host.available_size()
    if needed > 0:
        cache.evict_host(needed)
    return "host indices"


def _backup(cache: _Cache, pages: int) -> str:
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import backup_with_lane_room

    return backup_with_lane_room(_upstream_body, cache, 7, [0] * pages * PAGE, {}, [])


def test_a_backup_the_host_floor_holds_reads_no_phase_and_runs_upstreams_body(lane_aware) -> None:
    cache = lane_aware(phase=3, host_free_tokens=10 * PAGE)
    assert _backup(cache, pages=5) == "host indices"
    assert cache.tree_core.reads == 0 and cache.asked == []


def test_a_short_floor_hands_the_node_s_room_to_evict_host(lane_aware) -> None:
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import BackupRoom

    cache = lane_aware(phase=3, host_free_tokens=2 * PAGE)
    assert _backup(cache, pages=5) == "host indices"
    assert cache.tree_core.reads == 1
    assert cache.asked == [(3 * PAGE, BackupRoom(start_owner=3, pages=5))]
    assert BackupRoom(3, 5).demand(2) == [2, 3]  # pages 0..4 on lanes 1, 0, 1, 0, 1


def test_a_node_without_a_rotation_base_gets_upstreams_walk(lane_aware) -> None:
    cache = lane_aware(phase=None, host_free_tokens=0)
    _backup(cache, pages=2)
    assert cache.asked == [(2 * PAGE, None)]


def test_without_a_sharded_host_pool_nothing_is_read_and_no_room_is_passed() -> None:
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import room_for_backup

    cache = _Cache(phase=3, host_free_tokens=0)  # no extension registered
    _backup(cache, pages=2)
    assert cache.tree_core.reads == 0 and cache.asked == [(2 * PAGE, None)]
    assert room_for_backup(cache, 1, 2 * PAGE) is None


def test_a_caller_s_own_room_is_handed_over_as_a_keyword(lane_aware) -> None:
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import (
        BackupRoom,
        evict_host_for_backup,
        room_for_backup,
    )

    cache = lane_aware(phase=None, host_free_tokens=0)
    room = room_for_backup(cache, 1, 4 * PAGE)
    assert room == BackupRoom(start_owner=1, pages=4)
    assert evict_host_for_backup(cache.evict_host, room, 128) == 128
    assert evict_host_for_backup(cache.evict_host, room_for_backup(cache, None, 128), 64) == 64
    assert cache.asked == [(128, room), (64, None)]
