"""A cp 1 server reads the L3 file pages of a cp 2 sharded run (issue 24), real 0.5.23 stacks.

The writer (cp 2, the plugin's flag, owner writes under owner-free keys) stores one request
into a folder, once target-only and once with the packed MTP draft. Readers are fresh
unsharded stacks (one prefill rank, ``--tp 1``) on copies of the folders:

* with the flag (its one-prefill-rank mode: the record the real pipeline resolves, no
  sharding declared): the owner-free file backend, the writer's namespace id, every page a
  hit, the loaded device rows byte-exact against the writer's replicated logical KV
  (latent and indexer; the draft's too when packed);
* without the flag: upstream's ``HiCacheFile`` with its own keys, a clean miss.
"""

from __future__ import annotations

import shutil
from typing import Dict

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
PAGES = 5
LAYERS = 2
SEED = 20261202
TOKENS = list(range(1, PAGES * PAGE + 1))


def _config(mtp_draft: bool, sharded: bool):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

    return StackConfig(layer_num=LAYERS, cp_shared_kv=sharded, mtp_draft=mtp_draft)


def _kv(stack):
    """(target KV, draft KV or None) of TOKENS: the same draws on every stack."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_logical_kv

    target = storage.request_kv(stack, TOKENS, SEED)
    draft = draft_logical_kv(stack, len(TOKENS), SEED + 7) if stack.config.mtp_draft else None
    return target, draft


def write_run(ctx: RankContext, folders: Dict[str, str]) -> Dict[str, object]:
    """cp 2 writer: target-only into ``folders["target"]``, with the draft into
    ``folders["draft"]``; each folder's namespace id and object count."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    for name, mtp_draft in (("target", False), ("draft", True)):
        with sharded_stack(ctx, _config(mtp_draft, sharded=True)) as stack:
            backend = storage.attach_storage(stack, "file", extra={"file_storage_path": folders[name]})
            storage.store_request(stack, TOKENS, *_kv(stack))
            report[name] = backend.namespace.namespace_id
            storage.detach_storage(stack)
    return report


def read_run(ctx: RankContext, folder: str, flag: bool, mtp_draft: bool) -> Dict[str, object]:
    """One cp 1 restart on ``folder``: prefetch TOKENS, load back, compare bytes."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import owned_row_mismatches
    from sglang_cp_hicache.testing.v0_5_23.stack import apply_plugin_hooks, build_unsharded_stack
    from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode

    apply_plugin_hooks()
    report: Dict[str, object] = {}
    with build_unsharded_stack(ctx.attn_tp_group, _config(mtp_draft, sharded=False)) as stack:
        if flag:
            record = storage.publish_single_rank_flag_record(stack, "file")
            report["mode"] = cp_mode(record).value
        backend = storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        report["backend"] = type(backend).__name__
        namespace = getattr(backend, "namespace", None)
        report["namespace"] = namespace.namespace_id if namespace is not None else None
        report["hit"] = hit = storage.prefetch(stack, "r1", TOKENS)
        report["rejected_reads"] = getattr(backend, "rejected_reads", None)
        if hit:
            target, draft = _kv(stack)
            locs = storage.load_back(stack, TOKENS[:hit])
            pages = hit // PAGE
            target_kv = (target.latent[:, :hit], target.indexer[:, :pages])
            report["target"] = owned_row_mismatches(stack, locs, target_kv, stack.kv_pool, range(LAYERS))
            report["draft"] = []
            if draft is not None:
                draft_kv = (draft[0][:, :hit], draft[1][:, :pages])
                report["draft"] = owned_row_mismatches(stack, locs, draft_kv, stack.draft_kv_pool, range(1))
            report["loaded"] = len(locs)
        storage.detach_storage(stack)
    return report


#: cp 1 readers, each a fresh stack on its own folder copy: (folder written, flag, draft).
SCENARIOS = {
    "flag": ("target", True, False),
    "flag_draft": ("draft", True, True),
    "flag_off": ("target", False, False),
    "flag_off_draft": ("draft", False, True),
}


def read_scenarios(ctx: RankContext, folders: Dict[str, str]) -> Dict[str, Dict[str, object]]:
    return {name: read_run(ctx, folders[name], *SCENARIOS[name][1:]) for name in SCENARIOS}


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    folders = {name: str(tmp_path_factory.mktemp(name)) for name in ("target", "draft")}
    reports = run_ranks(2, write_run, folders)
    assert reports[0] == reports[1], "ranks disagree on the namespace"
    return folders, reports[0]


@pytest.fixture(scope="module")
def reads(written, tmp_path_factory) -> Dict[str, Dict[str, object]]:
    source_folders, _ = written
    folders = {}
    for name, (source, _, _) in SCENARIOS.items():
        folders[name] = str(tmp_path_factory.mktemp(name) / "l3")
        shutil.copytree(source_folders[source], folders[name])
    [per_scenario] = run_ranks(1, read_scenarios, folders)
    return per_scenario


@pytest.mark.parametrize("scenario", ["flag", "flag_draft"])
def test_cp1_with_the_flag_reads_every_page_byte_exact(written, reads, scenario):
    report = reads[scenario]
    source = SCENARIOS[scenario][0]
    assert report["mode"] == "one_rank_l3_reader"  # no sharding deltas, owner-free keys
    assert report["backend"] == "OwnerFreeHiCacheFile"
    assert report["namespace"] == written[1][source], "cp 1 and cp 2 namespaces differ"
    assert report["hit"] == len(TOKENS) and report["loaded"] == len(TOKENS)
    assert report["target"] == [] and report["draft"] == []
    assert report["rejected_reads"] == 0


@pytest.mark.parametrize("scenario", ["flag_off", "flag_off_draft"])
def test_cp1_without_the_flag_is_a_clean_miss(reads, scenario):
    report = reads[scenario]
    assert report["backend"] == "HiCacheFile" and report["namespace"] is None
    assert report["hit"] == 0
