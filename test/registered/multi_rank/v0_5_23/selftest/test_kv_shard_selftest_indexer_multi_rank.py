"""The 0.5.23 startup self-test's indexer stage, on real CPU gloo ranks (cp 2), through its hook.

A planted indexer fault: the sharded pool's logical index-K read
(``_PageInterleaveIndexKeyCache.get_k_and_scale``, what ``Indexer._get_topk_ragged`` reads)
returns the first page's scales from the next page, which the next owner holds; its keys
and every gathered scratch page stay right. The gather stage passes (the scratch holds the
right pages), so the refusal must name ``indexer``: a self-test whose indexer comparisons
were deleted would let the wrong top-k through to a later stage, or pass. Kept apart from
``test_kv_shard_selftest_multi_rank.py`` (which also runs the device check) so it runs in
well under a minute alone.
"""

import contextlib

import pytest

from sglang_cp_hicache.testing.dist import run_ranks

CP_SIZE = 2


@contextlib.contextmanager
def _first_page_scales_from_the_next_owner():
    """``get_k_and_scale`` with request 0's first page's scales read at its second page
    (owned by the next rank: owners are cyclic), keys untouched."""
    from sglang.srt.mem_cache.page_interleave_pool import _PageInterleaveIndexKeyCache

    right = _PageInterleaveIndexKeyCache.__dict__["get_k_and_scale"]

    def wrong(cache, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len):
        keys, scales = right(cache, layer_id, seq_len_tensor, page_indices, seq_len_sum, max_seq_len)
        moved = page_indices.clone()
        moved[0, 0] = page_indices[0, 1]
        _, wrong_scales = right(cache, layer_id, seq_len_tensor, moved, seq_len_sum, max_seq_len)
        scales = scales.clone()
        page = cache.pool.page_size
        scales[:page] = wrong_scales[:page]
        return keys, scales

    _PageInterleaveIndexKeyCache.get_k_and_scale = wrong
    try:
        yield
    finally:
        _PageInterleaveIndexKeyCache.get_k_and_scale = right


def _rank(ctx):
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import FLASHMLA_SPARSE_BF16
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.selftest_kernels import selftest_runner
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup
    from sglang_cp_hicache.v0_5_23.selftest import kv_shard_selftest

    group = GlooShardGroup.from_rank_context(ctx)
    with read_path_session(group, kv_format=FLASHMLA_SPARSE_BF16) as rank:
        with _first_page_scales_from_the_next_owner():
            try:
                kv_shard_selftest.init_attention_backends_after(None, selftest_runner(rank))
            except kv_shard_selftest.KvShardSelfTestFailed as refusal:
                return {"stage": refusal.stage, "rank": refusal.rank, "message": str(refusal)}
    return {"stage": None, "message": "the self-test passed"}


@pytest.fixture(scope="module")
def per_rank():
    return run_ranks(CP_SIZE, _rank, timeout_s=300.0)


def test_wrong_owner_scales_in_the_index_read_refuse_naming_the_indexer_stage(per_rank):
    for rank, refusal in enumerate(per_rank):
        assert refusal["stage"] == "indexer", f"rank {rank}: {refusal['message']}"
        assert refusal["rank"] == rank and "Refusing to serve" in refusal["message"]
        assert "layer 0: index-K scales read differ" in refusal["message"], refusal["message"]
