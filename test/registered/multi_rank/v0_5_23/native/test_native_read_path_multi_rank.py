"""Upstream 0.5.23's sharded DSA read path across real CPU ranks equals the replicated one,
in both formats an H200 resolves (``flashmla_sparse`` over bf16 rows; ``flashmla_kv`` over
the packed fp8 rows through 64-token blocks).

cp 2 and 3 gloo ranks run one prefill extend (three requests: two with cached page-aligned
prefixes, the second sharing the first's leading pages; every chunk ends mid-page) through
the real ``PageInterleaveDSATokenToKVPool`` and ``DeepseekSparseAttnBackend``
(:mod:`sglang_cp_hicache.testing.v0_5_23.read_path`). Each rank's top-k, index-K reads,
per-layer attention output and final hidden states equal an unsharded ``DSATokenToKVPool``
run bit for bit, and its pool holds only its owned pages.

Planted faults, patched into upstream's classes in each rank process, must break the
comparison exactly where they act: an off-by-one page and a wrong-owner block in the
backend's translated ``page_table_1`` (the indexer, which reads through ``_page_pos``, stays
right), an off-by-one page in the indexer's own page translation, and a skipped prefix
gather of the last layer (a stale scratch slot). A prefix that ends mid-page is refused by
upstream before any collective.
"""

import contextlib
import dataclasses

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

STALE_LAYER = 2  # the last layer: its slot still holds layer 0's prefix
FAULTS = ("off_by_one_page", "wrong_owner", "indexer_off_by_one_page", "stale_layer")
MID_PAGE_PREFIX_LENS = (150, 192, 0)  # request 0's prefix ends 22 tokens into a page


@contextlib.contextmanager
def _indexer_pages_rewritten(rewrite):
    """``rewrite(pages, logical_pages)`` applied to the scratch pages the indexer's
    ``get_index_k_scale_buffer`` maps its logical page table to."""
    from sglang.srt.mem_cache.page_interleave_pool import _PageInterleaveIndexKeyCache

    scratch_pages = _PageInterleaveIndexKeyCache.__dict__["_scratch_pages"]

    def faulty(cache, layer_id, page_indices):
        return rewrite(scratch_pages(cache, layer_id, page_indices), page_indices)

    _PageInterleaveIndexKeyCache._scratch_pages = faulty
    try:
        yield
    finally:
        _PageInterleaveIndexKeyCache._scratch_pages = scratch_pages


def _planted(fault, rank):
    from sglang_cp_hicache.testing.v0_5_23.read_path import faults

    ps = rank.config.page_size
    shared_page = int(rank.batch.req_to_token[0, 0]) // ps  # both requests' first page
    if fault == "off_by_one_page":  # the attention table sends it to its neighbour

        def rewrite(pool, loc, rows):
            return torch.where(loc.long() // ps == shared_page, rows + ps, rows)

        return faults.scratch_table_rewritten(rewrite)
    if fault == "indexer_off_by_one_page":  # the indexer's index-K read does

        def rewrite(pages, logical_pages):
            return torch.where(logical_pages.long() == shared_page, pages + 1, pages)

        return _indexer_pages_rewritten(rewrite)
    if fault == "wrong_owner":  # each prefix page read from the next rank's gathered block
        return faults.scratch_table_rewritten(faults.wrong_owner)
    assert fault == "stale_layer"
    return faults.prefetch_skipped(lambda pool, layer_id: layer_id == STALE_LAYER)


def _rank(ctx, kv_format_name):
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    (kv_format,) = [f for f in KV_FORMATS if f.name == kv_format_name]
    with read_path_session(GlooShardGroup.from_rank_context(ctx), kv_format=kv_format) as rank:
        results = {"real": rank.compare_sharded_to_replicated()}
        for fault in FAULTS:
            with _planted(fault, rank):
                results[fault] = rank.compare_sharded_to_replicated()
        mid_page = rank.with_spec(dataclasses.replace(rank.spec, prefix_lens=MID_PAGE_PREFIX_LENS))
        try:
            mid_page.run(mid_page.pools.sharded())
            results["mid_page_prefix"] = None
        except AssertionError as refusal:  # every rank refuses in the plan, before any gather
            results["mid_page_prefix"] = str(refusal)
    return results


FORMATS = ("flashmla_sparse/bfloat16", "flashmla_kv/fp8_e4m3")
RUNS = [(cp, kv_format) for kv_format in FORMATS for cp in (2, 3)]


@pytest.fixture(scope="module", params=RUNS, ids=lambda run: f"cp{run[0]}-{run[1].split('/')[0]}")
def read_path_results(request):
    cp_size, kv_format_name = request.param
    return cp_size, run_ranks(cp_size, _rank, kv_format_name)


def test_sharded_read_path_equals_replicated_bit_for_bit(read_path_results):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        real = results["real"]
        assert real.identical, f"cp{cp_size} rank {rank}: {real}"
        assert real.table_translated, f"cp{cp_size} rank {rank}: kernel read the logical table"


def test_the_comparison_reads_prefix_shared_pages_and_chunk(read_path_results):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        coverage = results["real"].coverage
        assert coverage.query_rows > 0, (cp_size, rank, coverage)
        assert coverage.prefix_selections and coverage.chunk_selections, (cp_size, rank, coverage)
        assert coverage.shared_page_selections, (cp_size, rank, coverage)


def test_each_rank_holds_only_its_owned_pages_with_the_replicated_bytes(read_path_results):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        assert results["real"].pool_problems == (), f"cp{cp_size} rank {rank}"


@pytest.mark.parametrize("fault", ["off_by_one_page", "wrong_owner"])
def test_mistranslated_attention_table_is_detected(read_path_results, fault):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        result = results[fault]
        first, where = result.layers[0], f"cp{cp_size} rank {rank}: {result}"
        assert not result.identical and not first.attention_equal, where
        assert first.attention_max_abs_diff > 1e-2, where
        # The indexer reads through _page_pos, not the attention table: it stays right.
        assert first.topk_equal and first.index_read_equal, where


def test_mistranslated_indexer_page_is_detected(read_path_results):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        first = results["indexer_off_by_one_page"].layers[0]
        where = f"cp{cp_size} rank {rank}: {first}"
        assert not first.index_read_equal, where
        # Other keys change the selection, hence what attention reads.
        assert not first.topk_equal and not first.attention_equal, where


def test_stale_scratch_layer_is_detected_on_that_layer_only(read_path_results):
    cp_size, per_rank = read_path_results
    for rank, results in enumerate(per_rank):
        result = results["stale_layer"]
        where = f"cp{cp_size} rank {rank}: {result}"
        assert result.differing_layers("index_read") == (STALE_LAYER,), where
        assert result.differing_layers("attention") == (STALE_LAYER,), where
        assert not result.hidden_equal, where


def test_mid_page_prefix_is_refused_not_misread(read_path_results):
    _, per_rank = read_path_results
    for results in per_rank:
        refusal = results["mid_page_prefix"]
        assert refusal is not None and "physical-page-aligned prefixes" in refusal, refusal
