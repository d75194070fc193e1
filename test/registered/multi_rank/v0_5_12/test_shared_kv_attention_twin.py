"""CPU twin: sparse MLA prefill with a cached prefix, shared KV == replicated KV.

cp 2 and 4 gloo ranks; each shared-KV rank holds only its owned pages and materialises the
prefix through the real hook functions with each strategy, with and without prefetch.
The target is followed by a 1-layer MTP draft extend over the same logical locs (its own
pool, backend and hooked model class). Planted faults must make the comparison fail,
proving it can: a wrong page remap, a materialisation that drops the owners' shards, and
two draft-only ones (draft writes not owner-only; the draft model class left unhooked).
"""

import contextlib
import dataclasses

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

VARIANTS = [(s, p) for s in ("all_reduce", "all_gather") for p in (False, True)]


@contextlib.contextmanager
def _planted(fault):
    """Patch a fault into this rank's process; restored on exit."""
    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_materialize as mat
    from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks

    if fault == "swapped_remap":
        original = hooks.remap_nsa_metadata

        def swapped(metadata, mapping):  # dense pages 1 and 2 exchanged in the page tables
            dense = original(metadata, mapping)
            ps = mapping.layout.page_size

            def swap(table, unit):
                pages = table // unit
                pages = torch.where(pages == 1, 2, torch.where(pages == 2, 1, pages))
                return pages * unit + table % unit

            return dataclasses.replace(
                dense, page_table_1=swap(dense.page_table_1, ps), real_page_table=swap(dense.real_page_table, 1)
            )

        target, name, replacement = hooks, "remap_nsa_metadata", swapped
    elif fault == "dropped_shards":  # the collective runs but the owners' pages never arrive
        original = mat.OwnerPackedAllGather.launch

        def dropped(self, mapping, reader, layer_id):
            pending = original(self, mapping, reader, layer_id)
            return dataclasses.replace(pending, finish=pending.dense.flat.zero_)

        target, name, replacement = mat.OwnerPackedAllGather, "launch", dropped
    elif fault == "draft_not_owner_only":  # the draft's write translation skips ownership
        original = hooks.CpSharedKVForwardState.__dict__["build"]  # the classmethod

        def unfiltered(cls, runtime, backend, forward_batch):
            state = original.__func__(cls, runtime, backend, forward_batch)
            if len(state.pool.kv_buffer) != 1:  # the target (2 layers) stays correct
                return state
            logical = state.write_locs.logical
            physical = runtime.layout.logical_locs_to_physical(logical, validate=False)
            return dataclasses.replace(state, write_locs=dataclasses.replace(state.write_locs, physical=physical))

        target, name, replacement = hooks.CpSharedKVForwardState, "build", classmethod(unfiltered)
    elif fault == "draft_unhooked":  # the draft model class's forward is not wrapped
        from sglang_cp_hicache.testing import reference_sparse_mla as ref
        from sglang_cp_hicache.testing.v0_5_12 import shared_kv_twin as twin

        target, name = twin.HookedDraftModel, "forward"
        original, replacement = target.__dict__["forward"], ref.ReferenceSparseMLAModel.forward
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, original)


def _rank(ctx, cp_size):
    from sglang_cp_hicache.testing.reference_sparse_mla import TINY_CONFIG
    from sglang_cp_hicache.testing.v0_5_12.shared_kv_twin import (
        TwinBatchSpec,
        TwinRank,
        compare_shared_to_replicated,
    )

    from sglang_cp_hicache.v0_5_12.layers.attention.nsa_backend_hooks import SharedKVUnsupportedPath

    twin = TwinRank(TINY_CONFIG, TwinBatchSpec(), ctx.cp_group, ctx.rank, cp_size)
    results = {"real": compare_shared_to_replicated(twin, VARIANTS)}
    for fault in ("swapped_remap", "dropped_shards", "draft_not_owner_only"):
        with _planted(fault):
            results[fault] = compare_shared_to_replicated(twin, [("all_gather", True)])
    with _planted("draft_unhooked"):  # every rank refuses before any collective
        try:
            twin.run_shared("all_gather", True)
            results["draft_unhooked"] = None
        except SharedKVUnsupportedPath as exc:
            results["draft_unhooked"] = str(exc)
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=lambda cp: f"cp{cp}")
def twin_results(request):
    return request.param, run_ranks(request.param, _rank, request.param)


def test_shared_kv_outputs_equal_replicated_outputs(twin_results):
    cp_size, per_rank = twin_results
    for rank, results in enumerate(per_rank):
        assert len(results["real"]) == len(VARIANTS)
        for result in results["real"]:
            assert result.identical, f"cp{cp_size} rank {rank} {result}"


def test_each_rank_holds_only_its_owned_pages_with_the_right_bytes(twin_results):
    _, per_rank = twin_results
    for results in per_rank:
        for result in results["real"]:
            assert result.pool_problems == (), result


@pytest.mark.parametrize("fault", ["swapped_remap", "dropped_shards"])
def test_planted_faults_are_detected(twin_results, fault):
    _, per_rank = twin_results
    for results in per_rank:
        (result,) = results[fault]
        assert not result.identical and result.max_abs_diff > 1e-3, result
        # The draft reads its prefix through the same materialisation: it breaks too.
        assert not result.draft_identical and result.draft_max_abs_diff > 1e-3, result


def test_draft_outputs_equal_replicated_outputs(twin_results):
    cp_size, per_rank = twin_results
    for rank, results in enumerate(per_rank):
        for result in results["real"]:
            assert result.draft_identical is True, f"cp{cp_size} rank {rank} {result}"


def test_draft_pool_holds_the_targets_physical_slots_with_the_right_bytes(twin_results):
    _, per_rank = twin_results
    for results in per_rank:
        for result in results["real"]:
            assert result.draft_pool_problems == (), result


def test_draft_only_write_fault_is_detected_while_the_target_stays_right(twin_results):
    # Each layer materialises its prefix before the chunk is written, so a bad draft write
    # shows in the draft pool (what the next extend and HiCache backup read), not in this
    # forward's output.
    _, per_rank = twin_results
    problems = []
    for results in per_rank:
        (result,) = results["draft_not_owner_only"]
        assert result.identical and result.pool_problems == (), result
        assert result.draft_pool_problems, result  # every rank's draft pool is wrong
        problems += result.draft_pool_problems
    # Owned draft KV is overwritten (lost) on some rank, and non-owned tokens land on
    # physical slots the target never wrote on some rank.
    assert any("owned KV differs" in p for p in problems), problems
    assert any("draft slots differ from target slots" in p for p in problems), problems


def test_unhooked_draft_model_is_refused_not_silent(twin_results):
    _, per_rank = twin_results
    for results in per_rank:
        assert results["draft_unhooked"] is not None and "outside the hooked model" in results["draft_unhooked"]
