"""L3 on a real Mooncake store under CP shared KV (gloo ranks, ``mooncake_master`` on
loopback started and stopped by the fixture).

One cp 2 run: each page's owner writes it through upstream's ``MooncakeStore`` (owner-free
namespaced keys, zero-copy from its physical host rows); a fresh stack on the same ranks
(a restart) prefetches: byte-exact hits on the rows each rank owns. Then one page's
indexer object is evicted from the store (the KV object stays): the agreed hit ends
before that page on every rank. Then the master is killed (SIGKILL, by its pid): a new
request's backup is still acked on every rank within a bound, its KV stays served from the
device, a prefetch of the stored pages is a miss on every rank, and the failures are
counted. (Unreachable at startup: ``unit/v0_5_23/storage/test_mooncake_backend.py``.)
"""

from __future__ import annotations

import os
import signal
from typing import Dict, List

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks
from sglang_cp_hicache.testing.v0_5_23 import owned_kv

PAGE = 64
PAGES = 4
SEED = 20261202
TOKENS = list(range(1, PAGES * PAGE + 1))
EVICTED_PAGE = 1
OTHER = list(range(70_001, 70_001 + 3 * PAGE))
#: A dead master makes one client RPC block ~4.3 s inside Mooncake (measured); after the
#: first such batch the store answers without the client. A generous bound (loaded CI).
OUTAGE_BOUND_S = 15.0


def _stack(ctx: RankContext):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    # Mooncake's zero-copy path needs a page-first host layout.
    return sharded_stack(ctx, StackConfig(cp_shared_kv=True, mem_layout="page_first"))


def _indexer_key(backend, page: int) -> str:
    from array import array

    from sglang.srt.mem_cache.hicache_storage import PoolName, PoolTransfer
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(RadixKey(array("q", TOKENS)), None, page_size=PAGE)
    transfer = PoolTransfer(name=PoolName.INDEXER, host_indices=None)
    keys, _ = backend._get_hybrid_page_component_keys([hashes[page]], transfer)
    return backend._tag_keys(keys)[0]


def mooncake_run(ctx: RankContext, config: dict, master_pid: int) -> Dict[str, object]:
    """One stack, its clients alive throughout: Mooncake keeps objects in the segments its
    clients mount, so a writer that leaves takes its pages with it (a restart is the file
    backend's test)."""
    from sglang_cp_hicache.testing.v0_5_23 import storage

    report: Dict[str, object] = {}
    with _stack(ctx) as stack:
        backend = storage.attach_storage(stack, "mooncake", extra=config)
        report["backend"] = type(backend).__name__
        kv = storage.request_kv(stack, TOKENS, SEED)
        storage.store_request(stack, TOKENS, kv)
        storage.evict_everything(stack)
        report["hit"] = storage.prefetch(stack, "r1", TOKENS)
        if report["hit"] == len(TOKENS):
            locs = storage.load_back(stack, TOKENS)
            report["mismatches"] = owned_kv.owned_row_mismatches(stack, locs, kv)
            report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        storage.evict_everything(stack)
        if ctx.rank == 0:  # Mooncake evicts one component of one page
            key = _indexer_key(backend, EVICTED_PAGE)
            rc = backend.store.remove(key, True)
            assert rc == 0, (rc, key, backend.store.is_exist(key))
        torch.distributed.barrier(group=stack.shard_group.cpu_group)
        report["hit_after_eviction"] = storage.prefetch(stack, "r2", TOKENS)
        report["tree_after_eviction"] = stack.tree_snapshot()
        report.update(_master_killed(ctx, stack, backend, master_pid))
        storage.detach_storage(stack)
    return report


def _master_killed(ctx: RankContext, stack, backend, master_pid: int) -> Dict[str, object]:
    """Kill the master after the writes above; serve a new request and prefetch the old."""
    from sglang_cp_hicache.testing.v0_5_23 import storage

    if ctx.rank == 0:
        os.kill(master_pid, signal.SIGKILL)
    torch.distributed.barrier(group=stack.shard_group.cpu_group)
    kv = storage.request_kv(stack, OTHER, SEED)
    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(OTHER))
    owned_kv.write_owned_rows(stack, locs, kv)
    stack.insert(OTHER, locs, base)
    stack.cache.flush_pending_backups()
    ack_s = storage.wait_backups_acked_within(stack, OUTAGE_BOUND_S)
    report = {
        "outage_ack_s": ack_s,
        "outage_served_tokens": int(stack.match(OTHER).device_prefix_len),
        "outage_mismatches": owned_kv.owned_row_mismatches(stack, locs, kv),
    }
    storage.evict_everything(stack)  # only L3 could serve TOKENS now (r2 left a host page)
    hit, prefetch_s = storage.prefetch_within(stack, "r3", TOKENS, OUTAGE_BOUND_S)
    outage = backend.outage
    return {
        **report,
        "outage_hit": hit,
        "outage_prefetch_s": prefetch_s,
        "outage_counts": (outage.outages, outage.failed_batches, outage.skipped_batches),
        "outage_tree": stack.tree_snapshot(),
    }


@pytest.fixture(scope="module")
def master():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import free_ports, MooncakeMaster

    with MooncakeMaster(*free_ports(2)) as running:
        yield running


@pytest.fixture(scope="module")
def reports(master) -> List[Dict[str, object]]:
    return run_ranks(2, mooncake_run, master.client_config(), master.process.pid)


def test_owners_write_and_owners_read_byte_exact(reports):
    assert [r["backend"] for r in reports] == ["OwnerFreeMooncakeStore"] * 2
    assert [r["hit"] for r in reports] == [len(TOKENS)] * 2
    assert [r["mismatches"] for r in reports] == [[], []]
    assert sum(r["owned_pages"] for r in reports) == PAGES


def test_an_evicted_component_ends_the_agreed_hit(reports):
    assert [r["hit_after_eviction"] for r in reports] == [EVICTED_PAGE * PAGE] * 2
    assert reports[0]["tree_after_eviction"] == reports[1]["tree_after_eviction"]


def test_a_killed_master_turns_storage_into_counted_misses_and_serving_goes_on(reports):
    for rank, report in enumerate(reports):
        assert report["outage_ack_s"] < OUTAGE_BOUND_S, f"rank {rank}"  # acked, bounded
        assert report["outage_served_tokens"] == len(OTHER), f"rank {rank}"
        assert report["outage_mismatches"] == [], f"rank {rank}"
        # Only the first batch after the kill reached the client (and blocked in it); every
        # later one (the rest of the backup, the prefetch's hit query) was answered at once.
        outages, failed, skipped = report["outage_counts"]
        assert (outages, failed) == (1, 1) and skipped >= 1, (rank, report["outage_counts"])
    assert [r["outage_hit"] for r in reports] == [0, 0]  # the stored pages: a miss everywhere
    assert reports[0]["outage_tree"] == reports[1]["outage_tree"]
