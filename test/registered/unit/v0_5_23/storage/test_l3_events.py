"""The L3 events' pieces in one process (``v0_5_23.storage.l3_events``): each owner-free
backend names its medium (file DISK, Mooncake EXTERNAL; upstream's fault injector seen
through, any other backend none); a write's coalesced events cut to the pages written."""

from __future__ import annotations

from types import SimpleNamespace

import pytest


def test_each_owner_free_backend_names_its_medium():
    from sglang.srt.disaggregation.kv_events import StorageMedium
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageFailureInjector

    from sglang_cp_hicache.v0_5_23.storage.file_backend import OwnerFreeHiCacheFile
    from sglang_cp_hicache.v0_5_23.storage.l3_events import tier_medium
    from sglang_cp_hicache.v0_5_23.storage.mooncake_backend import OwnerFreeMooncakeStore

    file_backend = OwnerFreeHiCacheFile.__new__(OwnerFreeHiCacheFile)
    assert tier_medium(file_backend) == StorageMedium.DISK == "DISK"
    assert tier_medium(OwnerFreeMooncakeStore.__new__(OwnerFreeMooncakeStore)) == "EXTERNAL"
    assert tier_medium(HiCacheStorageFailureInjector(file_backend, 0.0, 0.0)) == "DISK"
    assert tier_medium(HiCacheFile.__new__(HiCacheFile)) is None


def _chain(first_hash: int, pages: int, page: int = 2, parent=None):
    from sglang.srt.disaggregation.kv_events import BlockStored

    return BlockStored(
        block_hashes=list(range(first_hash, first_hash + pages)), parent_block_hash=parent,
        token_ids=list(range(pages * page)), block_size=page, lora_id=None, medium="DISK",
    )  # fmt: skip


@pytest.mark.parametrize("count, hashes", [(0, []), (2, [10, 11]), (3, [10, 11, 12]), (4, [10, 11, 12, 20]), (9, [10, 11, 12, 20, 21])])
def test_a_write_s_events_are_cut_to_the_blocks_written(count, hashes):
    from sglang_cp_hicache.v0_5_23.storage.l3_events import first_blocks

    events = [_chain(10, 3), _chain(20, 2, parent=12)]
    kept = first_blocks(events, count)
    assert [h for e in kept for h in e.block_hashes] == hashes
    for event in kept:
        assert len(event.token_ids) == len(event.block_hashes) * event.block_size
    assert [len(e.block_hashes) for e in events] == [3, 2], "the held events are not changed"


def test_a_cache_without_an_extension_records_nothing():
    from sglang_cp_hicache.v0_5_23.storage.l3_events import write_backup_storage_around

    calls = []
    cache = SimpleNamespace(ongoing_backup={})

    def original(cache, node_id):
        calls.append(node_id)
        cache.ongoing_backup[5] = (node_id, None)

    write_backup_storage_around(original, cache, 3)
    assert calls == [3] and cache.ongoing_backup == {5: (3, None)}
