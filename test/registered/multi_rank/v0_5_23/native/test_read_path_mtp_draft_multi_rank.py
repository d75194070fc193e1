"""The EAGLE MTP draft's extend on a sharded PD prefill worker equals the replicated one, in
both H200 formats, across real CPU gloo ranks.

What upstream 0.5.23 runs there (paths under ``sglang/srt/``): after the target's prefill,
``speculative/eagle_worker_v2._draft_extend_for_prefill`` runs the NextN layer on the same
batch, whose forward mode stays EXTEND; the draft's backend is ``DraftBackendFactory``'s DSA
*prefill* backend (``speculative/draft_utils.py:214``), and an EXTEND batch dispatches to
``dsa_prefill_impl`` (``layers/attention/dsa_backend.py:1129-1138``, ``forward_extend``
:2186-2193): ``flashmla_sparse`` over bf16, ``flashmla_kv`` over packed fp8; ``fa3`` (the bf16
decode backend) is read only by decode, target-verify and draft-extend-v2 batches, which a
prefill worker never runs. The draft's pool is its own ``PageInterleaveDSATokenToKVPool``
(one layer) with the target's shard spec and group (``mem_cache/kv_cache_configurator.py:1922``).

:meth:`ReadPathRank.draft` builds exactly that: one layer, a draft-worker backend, after the
target's extend on the same rank. The prefill kernel of the format is what runs (counted);
a planted off-by-one page or wrong owner in the draft's translated table, or a draft layer
whose prefix gather never ran, breaks the comparison.
"""


import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks
from sglang_cp_hicache.testing.planted import counted_calls
from sglang_cp_hicache.testing.v0_5_23.read_path import faults

KERNELS = ("flash_mla_sparse_fwd", "flash_mla_with_kvcache")

FAULTS = {  # planted while the draft compares: its table, or its one layer's prefix gather
    "off_by_one_page": lambda: faults.scratch_table_rewritten(faults.prefix_rows_one_page_on),
    "wrong_owner": lambda: faults.scratch_table_rewritten(faults.wrong_owner),
    "gather_skipped": lambda: faults.prefetch_skipped(lambda pool, layer_id: pool.layer_num == 1),
}


def _rank(ctx, kv_format_name):
    import sys

    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS
    from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    (kv_format,) = [f for f in KV_FORMATS if f.name == kv_format_name]
    results, counts = {}, {}
    with read_path_session(GlooShardGroup.from_rank_context(ctx), kv_format=kv_format) as target:
        results["target"] = target.compare_sharded_to_replicated()
        draft = target.draft()
        with counted_calls(sys.modules[CpuKernelStandIns.FLASH_MLA_INTERFACE], KERNELS, counts):
            results["draft"] = draft.compare_sharded_to_replicated()
        same_batch = torch.equal(draft.batch.req_to_token, target.batch.req_to_token)
        results["draft_pool"] = (draft.pools.sharded().layer_num, same_batch)
        for fault, planted in FAULTS.items():
            with planted():
                results[fault] = draft.compare_sharded_to_replicated()
    results["counts"] = counts
    return results


RUNS = [(2, "flashmla_sparse/bfloat16"), (2, "flashmla_kv/fp8_e4m3"), (3, "flashmla_kv/fp8_e4m3")]


@pytest.fixture(scope="module", params=RUNS, ids=lambda run: f"cp{run[0]}-{run[1].split('/')[0]}")
def draft_results(request):
    cp_size, kv_format_name = request.param
    return cp_size, kv_format_name, run_ranks(cp_size, _rank, kv_format_name)


def test_the_draft_extend_reads_with_the_formats_prefill_kernel(draft_results):
    cp_size, kv_format_name, per_rank = draft_results
    fp8 = kv_format_name.startswith("flashmla_kv")
    kernel = "flash_mla_with_kvcache" if fp8 else "flash_mla_sparse_fwd"
    for rank, results in enumerate(per_rank):
        # one layer, replicated then sharded: two calls of the prefill kernel, nothing else
        assert results["counts"] == {kernel: 2}, (cp_size, kv_format_name, rank, results["counts"])
        assert results["draft_pool"] == (1, True)  # one layer, the target's batch


def test_the_draft_extend_equals_replicated_bit_for_bit(draft_results):
    cp_size, kv_format_name, per_rank = draft_results
    for rank, results in enumerate(per_rank):
        for who in ("target", "draft"):
            comparison, where = results[who], f"cp{cp_size} {kv_format_name} rank {rank} {who}"
            assert comparison.identical and comparison.table_translated, f"{where}: {comparison}"
            assert comparison.pool_problems == () and comparison.block_table_problems == (), where
        assert results["draft"].coverage.prefix_selections, results["draft"].coverage


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_mistranslated_or_stale_draft_read_is_detected(draft_results, fault):
    cp_size, kv_format_name, per_rank = draft_results
    for rank, results in enumerate(per_rank):
        (layer,) = results[fault].layers
        where = f"cp{cp_size} {kv_format_name} rank {rank} {fault}: {layer}"
        assert not layer.attention_equal and layer.attention_max_abs_diff > 1e-2, where
