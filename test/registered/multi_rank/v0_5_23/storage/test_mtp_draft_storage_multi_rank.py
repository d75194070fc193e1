"""L3 file storage of the packed MTP draft under CP shared KV, on the real 0.5.23 stack (gloo cp 2).

With the EAGLE MTP draft on (``StackConfig(mtp_draft=True)``) upstream packs the draft's
latent KV and DSA indexer as the host pools' tail layer, so a page's ``kv`` and ``indexer``
objects carry the draft's bytes after the target's (the storage namespace counts those
layers). A writer run stores one request (target and draft KV, different seeded draws);
reader runs are fresh stacks (a restart) on copies of the folder: an L3 prefetch, then a
load-back, and each rank checks the target's and the draft's device rows it owns. Faults:
one page's ``kv`` or ``indexer`` object without the draft's tail (a target-only object under
the draft's key), and a folder written without the draft (a target-only deployment).
"""

from __future__ import annotations

import os
import shutil
from array import array
from typing import Dict, List

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
PAGES = 5
LAYERS = 2
SEED = 20261204
TOKENS = list(range(1, PAGES * PAGE + 1))
OTHER = list(range(50_001, 50_001 + 2 * PAGE))
FAULT_PAGE = 2


def _stack(ctx: RankContext, mtp_draft: bool):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    return sharded_stack(ctx, StackConfig(layer_num=LAYERS, cp_shared_kv=True, mtp_draft=mtp_draft))


def _kv(stack, tokens):
    """(target KV, draft KV or None) of one request."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_logical_kv

    target = storage.request_kv(stack, tokens, SEED)
    draft = draft_logical_kv(stack, len(tokens), SEED + 11 + tokens[0]) if stack.config.mtp_draft else None
    return target, draft


def write_run(ctx: RankContext, folders: Dict[str, str]) -> Dict[str, int]:
    """The draft-on writer into ``folders["draft"]``, the target-only one into
    ``folders["target_only"]``: the objects each wrote (every rank sees the same folder)."""
    from sglang_cp_hicache.testing.v0_5_23 import storage

    for name, mtp_draft in (("draft", True), ("target_only", False)):
        with _stack(ctx, mtp_draft) as stack:
            storage.attach_storage(stack, "file", extra={"file_storage_path": folders[name]})
            for tokens in (TOKENS, OTHER):
                storage.store_request(stack, tokens, *_kv(stack, tokens))
            storage.detach_storage(stack)
    return {name: len(os.listdir(folder)) for name, folder in folders.items()}


def _page_object(folder: str, page: int, component: str) -> str:
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    hashes = get_storage_hash_str(RadixKey(array("q", TOKENS)), None, page_size=PAGE)
    names = [n for n in os.listdir(folder) if n.startswith(f"{hashes[page]}.{component}__")]
    assert len(names) == 1, names
    return os.path.join(folder, names[0])


def _drop_draft_tail(path: str) -> None:
    """Cut the draft's tail layer off a layer_first page object: what a target-only
    writer would have stored under this key."""
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size * LAYERS // (LAYERS + 1))


def read_run(ctx: RankContext, folder: str, fault: str) -> Dict[str, object]:
    import torch

    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import owned_row_mismatches

    report: Dict[str, object] = {}
    with _stack(ctx, mtp_draft=True) as stack:
        backend = storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        if fault in ("kv", "indexer") and ctx.rank == 0:
            _drop_draft_tail(_page_object(folder, FAULT_PAGE, fault))
        torch.distributed.barrier(group=stack.shard_group.cpu_group)
        target, draft = _kv(stack, TOKENS)
        report["hit"] = hit = storage.prefetch(stack, "r1", TOKENS)
        report["tree"] = stack.tree_snapshot()
        if hit:
            locs = storage.load_back(stack, TOKENS[:hit])
            prefix = lambda kv: (kv[0][:, :hit], kv[1][:, : hit // PAGE])  # noqa: E731
            target_kv = prefix((target.latent, target.indexer))
            report["target"] = owned_row_mismatches(stack, locs, target_kv, stack.kv_pool, range(LAYERS))
            report["draft"] = owned_row_mismatches(stack, locs, prefix(draft), stack.draft_kv_pool, range(1))
            report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        report["second_hit"] = storage.prefetch(stack, "r2", OTHER)
        report["rejected_reads"] = backend.rejected_reads
        storage.detach_storage(stack)
    return report


#: Reader scenarios, each a fresh stack on its own folder copy: (folder written, fault).
SCENARIOS = {
    "clean": ("draft", None),
    "kv_without_draft": ("draft", "kv"),
    "indexer_without_draft": ("draft", "indexer"),
    "target_only_folder": ("target_only", None),
}


def read_scenarios(ctx: RankContext, folders: Dict[str, str]) -> Dict[str, Dict[str, object]]:
    return {name: read_run(ctx, folders[name], SCENARIOS[name][1]) for name in SCENARIOS}


@pytest.fixture(scope="module")
def written(tmp_path_factory) -> Dict[str, str]:
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("draft", "target_only")}
    counts = run_ranks(2, write_run, folders)
    pages = PAGES + len(OTHER) // PAGE
    assert counts == [{"draft": 2 * pages, "target_only": 2 * pages}] * 2  # kv + indexer objects
    return folders


@pytest.fixture(scope="module")
def reads(written, tmp_path_factory) -> Dict[str, List[Dict[str, object]]]:
    folders = {}
    for name, (source, _) in SCENARIOS.items():
        folders[name] = str(tmp_path_factory.mktemp(name) / "l3")
        shutil.copytree(written[source], folders[name])
    per_rank = run_ranks(2, read_scenarios, folders)
    return {name: [rank[name] for rank in per_rank] for name in SCENARIOS}


def test_draft_pages_carry_the_draft_tail_in_their_objects(written):
    for component in ("kv", "indexer"):
        sizes = {name: os.path.getsize(_page_object(folder, 0, component)) for name, folder in written.items()}
        assert sizes["draft"] * LAYERS == sizes["target_only"] * (LAYERS + 1), (component, sizes)


def _assert_agreed(reports: List[Dict[str, object]], hit: int) -> None:
    assert [r["hit"] for r in reports] == [hit] * len(reports)
    for rank, report in enumerate(reports[1:], start=1):
        assert report["tree"] == reports[0]["tree"], f"rank {rank}'s tree differs"
    for rank, report in enumerate(reports):
        assert report.get("target", []) == [] and report.get("draft", []) == [], f"rank {rank}"


def test_a_fresh_read_restores_target_and_draft_bytes_exactly(reads):
    reports = reads["clean"]
    _assert_agreed(reports, len(TOKENS))
    assert sum(r["owned_pages"] for r in reports) == PAGES
    assert all(r["owned_pages"] > 0 for r in reports)
    assert [r["second_hit"] for r in reports] == [len(OTHER)] * 2


@pytest.mark.parametrize("scenario", ["kv_without_draft", "indexer_without_draft"])
def test_a_page_without_its_draft_bytes_shortens_the_agreed_hit(reads, scenario):
    reports = reads[scenario]
    _assert_agreed(reports, FAULT_PAGE * PAGE)
    assert sum(r["rejected_reads"] for r in reports) == 1  # its owner refused it
    assert [r["second_hit"] for r in reports] == [len(OTHER)] * 2  # the prefetch thread lives


def test_a_target_only_store_is_never_a_hit_for_a_draft_deployment(reads):
    reports = reads["target_only_folder"]
    assert [(r["hit"], r["second_hit"]) for r in reports] == [(0, 0)] * 2
