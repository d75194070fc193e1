"""Upstream 0.5.23's sharded read path at cp 8 (GLM-5's prefill CP size) equals the
replicated one, across 8 real CPU gloo ranks, in both H200 formats (``flashmla_sparse`` over
bf16 rows, ``flashmla_kv`` over packed fp8 rows).

The cp 2 / 3 file (``test_native_read_path_multi_rank.py``) plants every fault; here the
largest group runs the real comparison and the one fault whose reach grows with the group:
each prefix page read from the next rank's gathered block (wrong owner). One batch with a
shared page-aligned prefix and chunks ending mid-page, as there.
"""

import pytest

from sglang_cp_hicache.testing.dist import run_ranks

CP_SIZE = 8


def _rank(ctx, kv_format_name):
    from sglang_cp_hicache.testing.v0_5_23.read_path import faults
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    (kv_format,) = [f for f in KV_FORMATS if f.name == kv_format_name]
    with read_path_session(GlooShardGroup.from_rank_context(ctx), kv_format=kv_format) as rank:
        results = {"real": rank.compare_sharded_to_replicated()}
        with faults.scratch_table_rewritten(faults.wrong_owner):
            results["wrong_owner"] = rank.compare_sharded_to_replicated()
    return results


@pytest.fixture(
    scope="module",
    params=["flashmla_sparse/bfloat16", "flashmla_kv/fp8_e4m3"],
    ids=lambda name: name.split("/")[0],
)
def per_rank(request):
    return run_ranks(CP_SIZE, _rank, request.param)


def test_cp8_sharded_read_path_equals_replicated_bit_for_bit(per_rank):
    for rank, results in enumerate(per_rank):
        real = results["real"]
        assert real.identical and real.table_translated, f"cp8 rank {rank}: {real}"
        assert real.pool_problems == (), f"cp8 rank {rank}"
        assert real.coverage.prefix_selections and real.coverage.chunk_selections, real.coverage


def test_cp8_wrong_owner_is_detected(per_rank):
    detected = [not results["wrong_owner"].identical for results in per_rank]
    # a rank whose queries never select a prefix token cannot see it; most must
    assert sum(detected) >= CP_SIZE // 2, detected
    for rank, results in enumerate(per_rank):
        if results["real"].coverage.prefix_selections and not detected[rank]:
            pytest.fail(f"cp8 rank {rank}: wrong owner read the replicated bytes")
