"""The backup scope's start owner is read off the node only when a host eviction asks for
it: a rotation phase walks the node's whole path, and most backups find host room."""

from __future__ import annotations

from typing import Any, List, Optional


class _TreeCore:
    """Counts the phase reads (what ``UnifiedTreeCore.rotation_phase_of`` costs a walk)."""

    page_size = 64

    def __init__(self, phase: Optional[int]) -> None:
        self.phase, self.reads = phase, 0

    def rotation_phase_of(self, node_id: Any) -> Optional[int]:
        self.reads += 1
        return self.phase


def _spec_in_scope(tree_core: _TreeCore, pages: int):
    """Run ``build_backup_spec_around`` inside a backup scope; return the scope's room."""
    from types import SimpleNamespace

    from sglang_cp_hicache.v0_5_23.cache import cache_extension
    from sglang_cp_hicache.v0_5_23.eviction import host_lane_eviction as hle

    extension = SimpleNamespace(backup_room=cache_extension.CallScope())
    cache_extension._register(tree_core, extension)
    with extension.backup_room.opened(hle._BackupRoom()) as room:
        spec = hle.build_backup_spec_around(lambda core, node_id: ([0] * pages * 64, {}), tree_core, 7)
    assert len(spec[0]) == pages * 64
    return room


def test_the_spec_records_the_node_without_reading_its_phase() -> None:
    core = _TreeCore(phase=3)
    room = _spec_in_scope(core, pages=5)
    assert core.reads == 0 and room.pages == 5


def test_the_owner_is_read_once_on_first_use_and_gives_the_cyclic_demand() -> None:
    core = _TreeCore(phase=3)
    room = _spec_in_scope(core, pages=5)
    assert room.resolve_owner() == 3 and room.resolve_owner() == 3
    assert core.reads == 1
    demand: List[int] = room.demand(2)
    assert demand == [2, 3]  # pages 0..4 on lanes 1, 0, 1, 0, 1


def test_a_node_without_a_rotation_base_has_no_owner() -> None:
    core = _TreeCore(phase=None)
    room = _spec_in_scope(core, pages=2)
    assert room.resolve_owner() is None


def test_a_room_opened_with_its_owner_reads_no_node() -> None:
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import _BackupRoom

    assert _BackupRoom(start_owner=1, pages=2).resolve_owner() == 1
