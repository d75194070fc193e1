"""CPU twin: sparse MLA prefill with a cached prefix, shared KV == replicated KV.

cp 2 and 4 gloo ranks; each shared-KV rank holds only its owned pages and materialises the
prefix through the real hook functions with each strategy, with and without prefetch.
Two planted faults (a wrong page remap, a materialisation that drops the owners' shards)
must make the comparison fail, proving it can.
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
    from sglang_cp_hicache.layers.attention import cp_shared_kv_materialize as mat
    from sglang_cp_hicache.layers.attention import nsa_backend_hooks as hooks

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
    else:  # "dropped_shards": the collective runs but the owners' pages never arrive
        original = mat.OwnerPackedAllGather.launch

        def dropped(self, mapping, reader, layer_id):
            pending = original(self, mapping, reader, layer_id)
            return dataclasses.replace(pending, finish=pending.dense.flat.zero_)

        target, name, replacement = mat.OwnerPackedAllGather, "launch", dropped
    setattr(target, name, replacement)
    try:
        yield
    finally:
        setattr(target, name, original)


def _rank(ctx, cp_size):
    from sglang_cp_hicache.testing.reference_sparse_mla import TINY_CONFIG
    from sglang_cp_hicache.testing.shared_kv_twin import (
        TwinBatchSpec,
        TwinRank,
        compare_shared_to_replicated,
    )

    twin = TwinRank(TINY_CONFIG, TwinBatchSpec(), ctx.cp_group, ctx.rank, cp_size)
    results = {"real": compare_shared_to_replicated(twin, VARIANTS)}
    for fault in ("swapped_remap", "dropped_shards"):
        with _planted(fault):
            results[fault] = compare_shared_to_replicated(twin, [("all_gather", True)])
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
