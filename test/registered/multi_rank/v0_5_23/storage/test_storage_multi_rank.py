"""L3 file storage under CP shared KV on the real 0.5.23 sharded stack (gloo ranks).

A writer run (cp 2, the plugin's flag and hooks on) stores one request's KV and indexer:
each page's owner writes it, under owner-free keys, into a shared folder. Reader runs are
fresh stacks (a restart) on the same folder, at cp 2 and cp 4: an L3 prefetch under the
root, wait-complete, then a load-back; each rank checks the bytes of the rows it owns now
against the logical KV the writer stored. Faults: a page deleted between the existence
check and the read on its reader, a page missing before the query, a torn file, and a
namespace mismatch (another model name, another host layout with the same geometry).
A restart at cp 3 reads the cp 2 folder too (owners that do not divide the writer's).
The writer run also checks the prefetch start-owner rule: an operation with no recorded
start owner raises, a recorded one places its host slots cyclically from it.
"""

from __future__ import annotations

import os
from typing import Dict, List, Optional

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks
from sglang_cp_hicache.testing.v0_5_23 import owned_kv

PAGE = 64
PAGES = 5
SEED = 20261201
TOKENS = list(range(1, PAGES * PAGE + 1))
OTHER = list(range(50_001, 50_001 + 2 * PAGE))
FAULT_PAGE = 2


def _stack(ctx: RankContext, layout: str = "layer_first"):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    return sharded_stack(ctx, StackConfig(cp_shared_kv=True, mem_layout=layout))


def write_run(ctx: RankContext, folder: str) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23 import storage

    with _stack(ctx) as stack:
        backend = storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        for tokens in (TOKENS, OTHER):
            storage.store_request(stack, tokens, storage.request_kv(stack, tokens, SEED))
        report = {
            "backend": type(backend).__name__,
            "writer": stack.controller.storage_config.is_storage_writer,
            "pending": len(stack.cache.ongoing_backup),
            "start_owner": _start_owner_rule(stack),
        }
        storage.detach_storage(stack)
    return report


def _start_owner_rule(stack) -> Dict[str, object]:
    """Allocate a 2-page prefetch's host slots with no, a root (None) and each recorded
    start owner; the owners of the logical host pages it got (``core.rotation.lane_of`` of each)."""
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation
    from sglang.srt.mem_cache.radix_cache import RadixKey

    from sglang_cp_hicache.core.rotation import lane_of
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
    from sglang_cp_hicache.v0_5_23.storage.owner_io import (
        PrefetchStartOwnerMissing,
    )

    controller, size = stack.controller, 2 * PAGE
    operation = PrefetchOperation(CacheRequestHandle("unrecorded", 0), array("q", TOKENS[:size]), None)
    free_before = stack.host_available()
    try:
        controller.alloc_prefetch_host_buffers(operation, size)
        unrecorded = "allocated"
    except PrefetchStartOwnerMissing as exc:
        unrecorded = str(exc)
    owners = {}
    for recorded in (None, 0, 1):
        extension_of(stack.cache).start_owners[operation] = recorded
        slots = controller.alloc_prefetch_host_buffers(operation, size)
        owners[recorded] = lane_of(slots[::PAGE] // PAGE, stack.shard_size).tolist()
        controller.mem_pool_host.free(slots)
    return {
        "unrecorded": unrecorded,
        "operation_id": operation.id,
        "owners": owners,
        "free_restored": stack.host_available() == free_before,
    }


def _page_file(folder: str, page: int) -> str:
    """The KV object of page ``page`` of TOKENS (found by the writer's own key rule)."""
    from sglang.srt.mem_cache.utils import get_storage_hash_str
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from array import array

    hashes = get_storage_hash_str(RadixKey(array("q", TOKENS)), None, page_size=PAGE)
    names = [n for n in os.listdir(folder) if n.startswith(f"{hashes[page]}.kv__")]
    assert len(names) == 1, names
    return os.path.join(folder, names[0])


def read_run(
    ctx: RankContext, folder: str, fault: Optional[str] = None, layout: str = "layer_first",
    model_name: str = "test-model",
) -> Dict[str, object]:  # fmt: skip
    from sglang_cp_hicache.testing.v0_5_23 import storage

    report: Dict[str, object] = {}
    with _stack(ctx, layout) as stack:
        backend = storage.attach_storage(
            stack, "file", model_name=model_name, extra={"file_storage_path": folder}
        )
        if fault == "missing" and ctx.rank == 0:
            os.remove(_page_file(folder, FAULT_PAGE))
        if fault == "torn" and ctx.rank == 0:
            path = _page_file(folder, FAULT_PAGE)
            with open(path, "r+b") as handle:
                handle.truncate(os.path.getsize(path) // 2)
        torch.distributed.barrier(group=stack.shard_group.cpu_group)
        if fault == "deleted_after_check":
            _delete_before_read(backend, folder)
        kv = storage.request_kv(stack, TOKENS, SEED)
        report["hit"] = storage.prefetch(stack, "r1", TOKENS)
        report["tree"] = stack.tree_snapshot()
        if report["hit"]:
            locs = storage.load_back(stack, TOKENS[: report["hit"]])
            report["mismatches"] = owned_kv.owned_row_mismatches(stack, locs, _prefix(kv, report["hit"]))
            report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        # The prefetch thread survives a fault: a second request still hits whole.
        report["second_hit"] = storage.prefetch(stack, "r2", OTHER)
        report["rejected_reads"] = getattr(backend, "rejected_reads", None)
        storage.detach_storage(stack)
    return report


def _prefix(kv, tokens: int):
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import LogicalKV

    return LogicalKV(kv.latent[:, :tokens], kv.indexer[:, : tokens // PAGE])


def _delete_before_read(backend, folder: str) -> None:
    """Delete page FAULT_PAGE's KV object when a reader asks for it: after every rank's
    existence check (the hit MIN has passed), before the read."""
    original = backend.batch_get
    target = os.path.basename(_page_file(folder, FAULT_PAGE))[: -len(".bin")]

    def batch_get(keys, target_locations, target_sizes=None):
        for key in keys:
            if backend._get_suffixed_key(key) == target:
                os.remove(os.path.join(folder, target + ".bin"))
        return original(keys, target_locations, target_sizes)

    backend.batch_get = batch_get


#: Reader scenarios of the cp 2 run, each a fresh stack (a restart) on its own folder copy:
#: (fault, host layout, model name).
SCENARIOS = {
    "clean": (None, "layer_first", "test-model"),
    "deleted_after_check": ("deleted_after_check", "layer_first", "test-model"),
    "missing": ("missing", "layer_first", "test-model"),
    "torn": ("torn", "layer_first", "test-model"),
    "other_model": (None, "layer_first", "other-model"),
    "other_layout": (None, "page_first", "test-model"),
}


def read_scenarios(ctx: RankContext, folders: Dict[str, str]) -> Dict[str, Dict[str, object]]:
    """Every scenario of :data:`SCENARIOS` in turn, on fresh stacks in these processes."""
    return {name: read_run(ctx, folders[name], *SCENARIOS[name]) for name in SCENARIOS}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("l3"))
    reports = run_ranks(2, write_run, path)
    assert [r["backend"] for r in reports] == ["OwnerFreeHiCacheFile"] * 2
    assert all(r["writer"] for r in reports), "every CP rank must be a writer"
    assert [r["pending"] for r in reports] == [0, 0]
    return path, reports


@pytest.fixture(scope="module")
def folder(written) -> str:
    return written[0]


@pytest.fixture(scope="module")
def cp2(folder, tmp_path_factory) -> Dict[str, List[Dict[str, object]]]:
    import shutil

    folders = {}
    for name in SCENARIOS:
        folders[name] = str(tmp_path_factory.mktemp(name) / "l3")
        shutil.copytree(folder, folders[name])
    per_rank = run_ranks(2, read_scenarios, folders)
    return {name: [rank[name] for rank in per_rank] for name in SCENARIOS}


def _assert_agreed(reports: List[Dict[str, object]], hit: int) -> None:
    assert [r["hit"] for r in reports] == [hit] * len(reports)
    for rank, report in enumerate(reports[1:], start=1):
        assert report["tree"] == reports[0]["tree"], f"rank {rank}'s tree differs"
    for rank, report in enumerate(reports):
        assert report.get("mismatches", []) == [], f"rank {rank}"
        assert report["second_hit"] == len(OTHER), f"rank {rank}: prefetch thread died"


def test_every_page_and_component_is_stored_once_under_owner_free_keys(folder):
    names = sorted(os.listdir(folder))
    pages = PAGES + len(OTHER) // PAGE
    assert len([n for n in names if ".kv__" in n]) == pages
    assert len([n for n in names if ".indexer__" in n]) == pages
    assert not [n for n in names if "_cp" in n], "a key names a cp rank"


def _assert_fresh_owners_read_every_page(reports: List[Dict[str, object]]) -> None:
    _assert_agreed(reports, len(TOKENS))
    assert sum(r["owned_pages"] for r in reports) == PAGES  # each page read by one owner
    assert all(r["owned_pages"] > 0 for r in reports)


def test_cp2_restart_reads_byte_exact_hits(cp2):
    _assert_fresh_owners_read_every_page(cp2["clean"])


@pytest.mark.parametrize("cp", [3, 4])
def test_cp3_and_cp4_restarts_read_byte_exact_hits_with_fresh_owners(folder, cp):
    _assert_fresh_owners_read_every_page(run_ranks(cp, read_run, folder))


def test_a_prefetch_without_a_recorded_start_owner_raises(written):
    reports = written[1]
    for rank, report in enumerate(reports):
        rule = report["start_owner"]
        assert rule["unrecorded"].startswith("cp_hicache: L3 prefetch operation "), rule
        assert f"operation {rule['operation_id']} of request unrecorded on shard rank {rank}:" in rule["unrecorded"]
        assert rule["owners"][0] == [0, 1] and rule["owners"][1] == [1, 0], rule
        assert rule["free_restored"], f"rank {rank}: host slots leaked"
    # a root anchor: the least-full class, the same on every rank (replicated state)
    assert reports[0]["start_owner"]["owners"][None] == reports[1]["start_owner"]["owners"][None]


@pytest.mark.parametrize("fault", ["deleted_after_check", "missing", "torn"])
def test_one_missing_page_shortens_the_agreed_hit_on_every_rank(cp2, fault):
    reports = cp2[fault]
    _assert_agreed(reports, FAULT_PAGE * PAGE)
    if fault == "torn":
        assert sum(r["rejected_reads"] for r in reports) >= 1


@pytest.mark.parametrize("scenario", ["other_model", "other_layout"])
def test_namespace_mismatch_is_a_miss(cp2, scenario):
    reports = cp2[scenario]
    assert [r["hit"] for r in reports] == [0, 0]
    assert [r["second_hit"] for r in reports] == [0, 0]
