"""Readers at cp 1 and at cp 4 of a cp 2 write to a real Mooncake store (issue 24), real
0.5.23 stacks, gloo ranks, ``mooncake_master`` on loopback started and stopped by the fixture.

Mooncake keeps an object in the segments of the clients mounted when it was put, so a
writer that leaves takes its pages with it. The cp 2 writer ranks (the plugin's flag,
owner writes under owner-free keys) store one request twice, target-only and with the
packed MTP draft (two namespaces, one client per stack), and then hold their stacks and
clients (storage attached, like a serving fleet) until the fixture releases them, each
hold bounded. While they are held:

* cp 1 (one process, a fresh unsharded stack per scenario), in this order:
  * without the flag: upstream's ``MooncakeStore`` with its own keys, a clean miss;
  * with the flag and another model name (another namespace): a miss;
  * with the flag (its one-prefill-rank mode, the record the real pipeline resolves):
    every page a hit, the loaded device rows byte-exact (latent and indexer; the draft's
    too when packed) against the writer's replicated logical KV, the writer's namespace
    id. The misses ran first, so the objects were in the store when they missed; and the
    same rows checked against another draw differ (the byte check can fail);
* cp 4 (fresh owners that do not match the writer's): every page a hit, each rank's
  owned device rows byte-exact, every rank owning some, identical trees.

The readers regenerate the writer's logical KV from its seed; the writer's digest of it
proves they check against the same bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, List, Optional, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
PAGES = 5
LAYERS = 2
SEED = 20261202
TOKENS = list(range(1, PAGES * PAGE + 1))
MODEL = "test-model"
#: Namespace of each write: whether the stack packs the MTP draft.
MODES = {"target": False, "draft": True}
#: A held writer waits this long at most for the readers (loaded CI: generous).
HOLD_S = 240.0


def _config(mtp_draft: bool, sharded: bool):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig

    # Mooncake's zero-copy path needs a page-first host layout (writers and readers alike:
    # the layout is part of the namespace).
    return StackConfig(
        layer_num=LAYERS, cp_shared_kv=sharded, mtp_draft=mtp_draft, mem_layout="page_first"
    )


def _kv(stack, seed: int = SEED):
    """(target KV, draft KV or None) of TOKENS: the same draws on every stack."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_logical_kv

    target = storage.request_kv(stack, TOKENS, seed)
    draft = draft_logical_kv(stack, len(TOKENS), seed + 7) if stack.config.mtp_draft else None
    return target, draft


def _digest(target, draft) -> str:
    tensors = [target.latent, target.indexer] + (list(draft) if draft is not None else [])
    digest = hashlib.sha256()
    for tensor in tensors:
        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def write_and_hold(
    ctx: RankContext, flag_dir: str, hold_s: float, config: dict
) -> Dict[str, object]:
    """cp 2 writer: each mode's stack stores TOKENS and stays attached; then the rank holds
    (clients and segments alive) until released. Per mode: namespace id and KV digest."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import hold_until_released
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    with contextlib.ExitStack() as held:
        for mode, mtp_draft in MODES.items():
            stack = held.enter_context(sharded_stack(ctx, _config(mtp_draft, sharded=True)))
            backend = storage.attach_storage(stack, "mooncake", model_name=MODEL, extra=config)
            held.callback(storage.detach_storage, stack)
            target, draft = _kv(stack)
            storage.store_request(stack, TOKENS, target, draft)
            report[mode] = {
                "backend": type(backend).__name__,
                "namespace": backend.namespace.namespace_id,
                "digest": _digest(target, draft),
            }
        report["held_s"] = hold_until_released(ctx.rank, flag_dir, hold_s)
    return report


def _read(stack, config: dict, model_name: str) -> Dict[str, object]:
    """Attach, prefetch TOKENS from L3 alone (a fresh stack), load back, compare the owned
    device rows with the logical KV; detach."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import owned_row_mismatches

    backend = storage.attach_storage(stack, "mooncake", model_name=model_name, extra=config)
    namespace = getattr(backend, "namespace", None)
    target, draft = _kv(stack)
    report: Dict[str, object] = {
        "backend": type(backend).__name__,
        "namespace": namespace.namespace_id if namespace is not None else None,
        "digest": _digest(target, draft),
        "hit": storage.prefetch(stack, "r1", TOKENS),
    }
    report["tree"] = stack.tree_snapshot()
    hit = report["hit"]
    if hit:
        locs = storage.load_back(stack, TOKENS[:hit])
        pages = hit // PAGE

        def mismatches(kv_target, kv_draft) -> Tuple[List[str], List[str]]:
            latent = (kv_target.latent[:, :hit], kv_target.indexer[:, :pages])
            found = owned_row_mismatches(stack, locs, latent, stack.kv_pool, range(LAYERS))
            if kv_draft is None:
                return found, []
            rows = (kv_draft[0][:, :hit], kv_draft[1][:, :pages])
            return found, owned_row_mismatches(stack, locs, rows, stack.draft_kv_pool, range(1))

        report["loaded"] = len(locs)
        report["owned_pages"] = int(stack.owned_mask(locs[::PAGE]).sum())
        report["target"], report["draft"] = mismatches(target, draft)
        # The same rows against another draw: the byte check itself can fail.
        other_target, other_draft = _kv(stack, SEED + 1)
        report["other_draw"] = mismatches(other_target, other_draft)
    storage.detach_storage(stack)
    return report


#: cp 1 readers, in order (the misses first): (mode written, flag, model name).
CP1_SCENARIOS = {
    "flag_off": ("target", False, MODEL),
    "other_model": ("target", True, "other-model"),
    "flag": ("target", True, MODEL),
    "flag_draft": ("draft", True, MODEL),
}


def read_at_cp1(ctx: RankContext, config: dict) -> Dict[str, Dict[str, object]]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import apply_plugin_hooks, build_unsharded_stack
    from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode

    apply_plugin_hooks()
    reports = {}
    for name, (mode, flag, model_name) in CP1_SCENARIOS.items():
        with build_unsharded_stack(ctx.attn_tp_group, _config(MODES[mode], sharded=False)) as stack:
            cp_mode_value: Optional[str] = None
            if flag:
                record = storage.publish_single_rank_flag_record(stack, "mooncake")
                cp_mode_value = cp_mode(record).value
            reports[name] = {"mode": cp_mode_value, **_read(stack, config, model_name)}
    return reports


def read_at_cp4(ctx: RankContext, config: dict) -> Dict[str, Dict[str, object]]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    reports = {}
    for mode, mtp_draft in MODES.items():
        with sharded_stack(ctx, _config(mtp_draft, sharded=True)) as stack:
            reports[mode] = _read(stack, config, MODEL)
    return reports


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(writer reports per rank, cp 1 reports, cp 4 reports per rank): every reader runs
    while the writers are held."""
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import (
        free_ports,
        HeldRanks,
        MooncakeMaster,
    )

    flag_dir = str(tmp_path_factory.mktemp("held_writers"))
    # A 5 s lease like the simulator's masters: nothing is removed here, and a loaded
    # box's client warm-up outlived 50 ms (LEASE_EXPIRED).
    with MooncakeMaster(*free_ports(2), lease_ttl_ms=5000) as master:
        config = master.client_config()
        with HeldRanks(2, write_and_hold, (config,), flag_dir, hold_s=HOLD_S) as writers:
            [cp1] = run_ranks(1, read_at_cp1, config)
            cp4 = run_ranks(4, read_at_cp4, config)
        return writers.results(), cp1, cp4


def test_writers_agree_and_were_held_for_the_readers(runs):
    writers, _, _ = runs
    for mode in MODES:
        assert [w[mode]["backend"] for w in writers] == ["OwnerFreeMooncakeStore"] * 2
        assert writers[0][mode] == writers[1][mode], f"{mode}: ranks disagree"
    assert writers[0]["target"]["namespace"] != writers[0]["draft"]["namespace"]
    assert all(0 < w["held_s"] < HOLD_S for w in writers)  # released, not timed out


@pytest.mark.parametrize("scenario", ["flag", "flag_draft"])
def test_cp1_with_the_flag_reads_every_page_byte_exact(runs, scenario):
    writers, cp1, _ = runs
    report, written = cp1[scenario], writers[0][CP1_SCENARIOS[scenario][0]]
    assert report["mode"] == "one_rank_l3_reader"  # no sharding deltas, owner-free keys
    assert report["backend"] == "OwnerFreeMooncakeStore"
    assert report["namespace"] == written["namespace"], "cp 1 and cp 2 namespaces differ"
    assert report["digest"] == written["digest"], "the reader checks other bytes"
    assert report["hit"] == len(TOKENS) and report["loaded"] == len(TOKENS)
    assert report["target"] == [] and report["draft"] == []
    other_target, other_draft = report["other_draw"]
    assert other_target and (other_draft or scenario == "flag"), "the byte check cannot fail"


def test_cp1_without_the_flag_is_a_clean_miss(runs):
    report = runs[1]["flag_off"]
    assert report["backend"] == "MooncakeStore" and report["namespace"] is None
    assert report["hit"] == 0 and "loaded" not in report


def test_cp1_with_another_namespace_is_a_miss(runs):
    writers, cp1, _ = runs
    report = cp1["other_model"]
    assert report["backend"] == "OwnerFreeMooncakeStore"
    assert report["namespace"] != writers[0]["target"]["namespace"]
    assert report["hit"] == 0 and "loaded" not in report


@pytest.mark.parametrize("mode", list(MODES))
def test_cp4_fresh_owners_read_every_page_byte_exact(runs, mode):
    writers, _, cp4 = runs
    reports = [rank[mode] for rank in cp4]
    for rank, report in enumerate(reports):
        assert report["namespace"] == writers[0][mode]["namespace"], f"rank {rank}"
        assert report["digest"] == writers[0][mode]["digest"], f"rank {rank}"
        assert report["hit"] == len(TOKENS), f"rank {rank}"
        assert report["target"] == [] and report["draft"] == [], f"rank {rank}"
        assert report["tree"] == reports[0]["tree"], f"rank {rank}'s tree differs"
    owned = [r["owned_pages"] for r in reports]
    assert sum(owned) == PAGES and all(owned), owned  # each page read by one fresh owner
