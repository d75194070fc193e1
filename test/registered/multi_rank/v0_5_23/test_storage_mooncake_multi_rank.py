"""L3 on a real Mooncake store under CP shared KV (gloo ranks, ``mooncake_master`` on
loopback started and stopped by the fixture).

One cp 2 run: each page's owner writes it through upstream's ``MooncakeStore`` (owner-free
namespaced keys, zero-copy from its physical host rows); a fresh stack on the same ranks
(a restart) prefetches: byte-exact hits on the rows each rank owns. Then one page's
indexer object is evicted from the store (the KV object stays): the agreed hit ends
before that page on every rank. (Store unreachable at startup and mid-run: not tested
yet, see docs/l3_storage.md.)
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
PAGES = 4
SEED = 20261202
TOKENS = list(range(1, PAGES * PAGE + 1))
EVICTED_PAGE = 1


def _stack(ctx: RankContext):
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_sharded_stack

    # Mooncake's zero-copy path needs a page-first host layout.
    return build_sharded_stack(ctx, StackConfig(cp_shared_kv=True, mem_layout="page_first"))


def _indexer_key(backend, page: int) -> str:
    from array import array

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(RadixKey(array("q", TOKENS)), None, page_size=PAGE)
    transfer = PoolTransfer(name=PoolName.INDEXER, host_indices=None)
    keys, _ = backend._get_hybrid_page_component_keys([hashes[page]], transfer)
    return backend._tag_keys(keys)[0]


def mooncake_run(ctx: RankContext, config: dict) -> Dict[str, object]:
    """One stack, its clients alive throughout: Mooncake keeps objects in the segments its
    clients mount, so a writer that leaves takes its pages with it (a restart is the file
    backend's test)."""
    from sglang_cp_hicache.testing.v0_5_23 import storage

    storage.apply_plugin_hooks()
    report: Dict[str, object] = {}
    with _stack(ctx) as stack:
        backend = storage.attach_storage(stack, "mooncake", extra=config)
        report["backend"] = type(backend).__name__
        kv = storage.logical_kv(stack, TOKENS, SEED)
        storage.store_request(stack, TOKENS, kv)
        storage.evict_everything(stack)
        report["hit"] = storage.prefetch(stack, "r1", TOKENS)
        if report["hit"] == len(TOKENS):
            locs = storage.load_back(stack, TOKENS)
            report["mismatches"] = storage.owned_row_mismatches(stack, locs, kv)
            report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        storage.evict_everything(stack)
        if ctx.rank == 0:  # Mooncake evicts one component of one page
            key = _indexer_key(backend, EVICTED_PAGE)
            rc = backend.store.remove(key, True)
            assert rc == 0, (rc, key, backend.store.is_exist(key))
        torch.distributed.barrier(group=stack.shard_group.cpu_group)
        report["hit_after_eviction"] = storage.prefetch(stack, "r2", TOKENS)
        report["tree_after_eviction"] = stack.tree_snapshot()
        storage.detach_storage(stack)
    return report


@pytest.fixture(scope="module")
def master():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from sglang_cp_hicache.testing.v0_5_23.storage import MooncakeMaster, free_ports

    with MooncakeMaster(*free_ports(2)) as running:
        yield running


@pytest.fixture(scope="module")
def reports(master) -> List[Dict[str, object]]:
    return run_ranks(2, mooncake_run, master.client_config())


def test_owners_write_and_owners_read_byte_exact(reports):
    assert [r["backend"] for r in reports] == ["OwnerFreeMooncakeStore"] * 2
    assert [r["hit"] for r in reports] == [len(TOKENS)] * 2
    assert [r["mismatches"] for r in reports] == [[], []]
    assert sum(r["owned_pages"] for r in reports) == PAGES


def test_an_evicted_component_ends_the_agreed_hit(reports):
    assert [r["hit_after_eviction"] for r in reports] == [EVICTED_PAGE * PAGE] * 2
    assert reports[0]["tree_after_eviction"] == reports[1]["tree_after_eviction"]
