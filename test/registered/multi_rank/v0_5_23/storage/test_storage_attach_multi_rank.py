"""L3 attached at runtime under CP shared KV on the real 0.5.23 sharded stack (gloo cp 2).

A sharded HiCache stack started without storage (the plugin's flag on) attaches a backend
the way the admin API does (upstream's ``StorageAttachment.attach``, which refuses any
backend under sharding without the plugin). Then, as after a startup with storage: one
request's pages are written by their owners only (owner-free keys, every rank a writer),
device and host are evicted, a prefetch hits every page and each rank's owned rows read
back byte-exact (latent and indexer). Detach, then re-attach: a fresh backend that reads
the file backend's pages again, and writes and reads a new request on both backends.
Mooncake runs on a real ``mooncake_master`` on loopback (page-first host layout, as its
startup resolves).
"""

from __future__ import annotations

import os
from typing import Dict, List

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks
from sglang_cp_hicache.testing.v0_5_23 import owned_kv

PAGE = 64
PAGES = 5
SEED = 20261202
TOKENS = list(range(1, PAGES * PAGE + 1))
OTHER = list(range(80_001, 80_001 + 2 * PAGE))
ATTACHED = "Attached HiCache storage backend successfully."
DETACHED = "Detached HiCache storage backend successfully."
#: The host layout each backend starts with under the flag (Mooncake: page_first).
LAYOUTS = {"file": "layer_first", "mooncake": "page_first"}


def _page_hashes(tokens: List[int]) -> List[str]:
    from array import array

    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    return list(get_storage_hash_str(RadixKey(array("q", tokens)), None, page_size=PAGE))


def _recorded_writes(backend, written: List[str]) -> None:
    """Record, per call of the backend's own write seam, what this rank writes: page
    hashes (file: one key a component) or key counts (Mooncake: one batch of keys)."""
    if hasattr(backend, "_put_batch_zero_copy_impl"):
        put = backend._put_batch_zero_copy_impl

        def put_batch(key_strs, *args, **kwargs):
            written.extend(key_strs)
            return put(key_strs, *args, **kwargs)

        backend._put_batch_zero_copy_impl = put_batch
        return
    set_page = backend.set

    def set_recorded(key, *args, **kwargs):
        written.append(key.partition(".")[0])  # "<hash>" or "<hash>.<pool>"
        return set_page(key, *args, **kwargs)

    backend.set = set_recorded


def _store_evict_read(stack, tokens: List[int], rid: str) -> Dict[str, object]:
    """Write ``tokens``' KV through L3, keep only L3, prefetch and load back; the agreed
    hit, this rank's owned pages and any mismatch against the logical KV."""
    from sglang_cp_hicache.testing.v0_5_23 import storage

    kv = storage.request_kv(stack, tokens, SEED)
    locs = storage.store_request(stack, tokens, kv)
    owned = [h for h, mine in zip(_page_hashes(tokens), stack.owned_mask(locs[::PAGE])) if mine]
    return {"owned_hashes": owned, **_evict_read(stack, tokens, rid)}


def _evict_read(stack, tokens: List[int], rid: str) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23 import storage

    kv = storage.request_kv(stack, tokens, SEED)
    storage.evict_everything(stack)
    report: Dict[str, object] = {"hit": storage.prefetch(stack, rid, tokens)}
    if report["hit"] == len(tokens):
        locs = storage.load_back(stack, tokens)
        report["mismatches"] = owned_kv.owned_row_mismatches(stack, locs, kv)
        report["read_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
    report["tree"] = stack.tree_snapshot()
    return report


def attach_run(ctx: RankContext, backend_name: str, extra: dict) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    config = StackConfig(cp_shared_kv=True, mem_layout=LAYOUTS[backend_name])
    report: Dict[str, object] = {}
    with sharded_stack(ctx, config) as stack:
        cache, controller = stack.cache, stack.controller
        report["started_without_storage"] = (
            not cache.enable_storage and controller.storage_backend is None
        )
        report["attach"] = storage.attach_at_runtime(stack, backend_name, extra=extra)
        if not report["attach"][0]:
            return report  # refused: the test names the message
        backend = controller.storage_backend
        report["backend"] = type(backend).__name__
        report["writer"] = controller.storage_config.is_storage_writer
        written: List[str] = []
        _recorded_writes(backend, written)
        report["first"] = _store_evict_read(stack, TOKENS, "r1")
        report["written"] = list(written)

        report["detach"] = cache.detach_storage_backend()
        report["detached"] = not cache.enable_storage and controller.storage_backend is None
        report["reattach"] = storage.attach_at_runtime(stack, backend_name, extra=extra)
        report["fresh_backend"] = controller.storage_backend is not backend
        if backend_name == "file":  # Mooncake's objects left with the detached client
            report["reread"] = _evict_read(stack, TOKENS, "r2")
        report["other"] = _store_evict_read(stack, OTHER, "r3")
        report["final_detach"] = cache.detach_storage_backend()
    return report


def _assert_read_back_byte_exact(reports: List[Dict[str, object]], key: str, pages: int) -> None:
    assert [r[key]["hit"] for r in reports] == [pages * PAGE] * len(reports), key
    assert [r[key]["mismatches"] for r in reports] == [[]] * len(reports), key
    assert sum(r[key]["read_pages"] for r in reports) == pages, key  # each page by its owner
    assert reports[0][key]["tree"] == reports[1][key]["tree"], f"{key}: trees differ"


def _assert_attached_as_at_startup(reports: List[Dict[str, object]], backend_class: str) -> None:
    for rank, report in enumerate(reports):
        assert report["started_without_storage"], f"rank {rank}"
        assert report["attach"] == (True, ATTACHED), f"rank {rank}: {report['attach']}"
        assert report["backend"] == backend_class, f"rank {rank}"
        assert report["writer"], f"rank {rank}: every CP rank must be a writer"
        assert report["detach"] == (True, DETACHED) and report["detached"], f"rank {rank}"
        assert report["reattach"] == (True, ATTACHED), f"rank {rank}: {report['reattach']}"
        assert report["fresh_backend"], f"rank {rank}"
        assert report["final_detach"] == (True, DETACHED), f"rank {rank}"
    _assert_read_back_byte_exact(reports, "first", PAGES)
    _assert_read_back_byte_exact(reports, "other", len(OTHER) // PAGE)


@pytest.fixture(scope="module")
def file_run(tmp_path_factory):
    folder = str(tmp_path_factory.mktemp("l3_attach"))
    return folder, run_ranks(2, attach_run, "file", {"file_storage_path": folder})


def test_file_attached_at_runtime_serves_as_at_startup(file_run):
    _, reports = file_run
    _assert_attached_as_at_startup(reports, "OwnerFreeHiCacheFile")
    _assert_read_back_byte_exact(reports, "reread", PAGES)  # the re-attached backend


def test_file_owners_write_only_their_pages_under_owner_free_keys(file_run):
    folder, reports = file_run
    hashes = _page_hashes(TOKENS)
    for rank, report in enumerate(reports):
        owned = report["first"]["owned_hashes"]
        assert owned, f"rank {rank} owns no page"
        # KV and indexer of each owned page, nothing of another rank's
        assert sorted(report["written"]) == sorted(owned * 2), f"rank {rank}"
    assert sorted(h for r in reports for h in r["first"]["owned_hashes"]) == sorted(hashes)
    names = os.listdir(folder)
    for component in ("kv", "indexer"):
        found = sorted(n.split(".")[0] for n in names if f".{component}__" in n)
        assert found == sorted(hashes + _page_hashes(OTHER)), component
    assert not [n for n in names if "_cp" in n], "a key names a cp rank"


@pytest.fixture(scope="module")
def mooncake_reports():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import free_ports, MooncakeMaster

    with MooncakeMaster(*free_ports(2)) as master:
        yield run_ranks(2, attach_run, "mooncake", master.client_config())


def test_mooncake_attached_at_runtime_serves_as_at_startup(mooncake_reports):
    _assert_attached_as_at_startup(mooncake_reports, "OwnerFreeMooncakeStore")
    # Owner writes: each rank put keys for its owned pages only, the same number a page.
    owned = [len(r["first"]["owned_hashes"]) for r in mooncake_reports]
    puts = [len(r["written"]) for r in mooncake_reports]
    assert sum(owned) == PAGES and all(owned), owned
    assert puts[0] * owned[1] == puts[1] * owned[0] and puts[0] > 0, (puts, owned)
