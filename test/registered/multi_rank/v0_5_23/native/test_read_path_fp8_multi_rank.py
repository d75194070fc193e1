"""The ``flashmla_kv`` / fp8_e4m3 twin: upstream 0.5.23's sharded read path over the packed
fp8 rows (656 bytes: fp8 NoPE, fp32 scales, bf16 RoPE) equals the replicated one, and so does
a chunked prefill whose second chunk reads, as its prefix, what the first chunk wrote.

The one-extend comparison with every planted fault runs for both formats at cp 2 and 3 in
``test_native_read_path_multi_rank.py`` and at cp 8 in ``test_read_path_cp8_multi_rank.py``.
Here, at cp 2 and 3 gloo ranks: the fp8 kernels really ran (FlashMLA's sparse decode kernel
and schedule, the packed store's quantizer, over a pool of packed rows); a chunked prefill
(first chunks ending on a page, second chunks mid-page) is bit-exact in both formats, and an
owner write of the first chunk planted one page off breaks exactly the second chunk. Then,
in this process, the reference kernels themselves: the quantizer's bytes are the format's,
and the FlashMLA reference reads through the block view (moving blocks without their indices
changes the output; moving both does not), refusing a schedule made for another batch.
"""

import contextlib
import dataclasses

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks
from sglang_cp_hicache.testing.planted import counted_calls
from sglang_cp_hicache.testing.v0_5_23.flashmla_kv_reference import (
    dequantize_packed_rows,
    flash_mla_with_kvcache_reference,
    get_mla_metadata_reference,
    packed_row_bytes,
    quantize_k_cache_separate_reference,
)

FIRST_CHUNK_LENS = (64, 64, 64)  # prefixes 192, 192, 0: every first chunk ends on a page
CHUNKED_EXTEND_LENS = (109, 134, 84)  # second chunks 45, 70, 20: they end mid-page
FP8_KERNELS = ("flash_mla_with_kvcache", "get_mla_metadata")


@contextlib.contextmanager
def _chunk_owner_writes_one_page_off():
    """During a sharded extend, the owned rows the forward persists land one page off (the
    scratch stage keeps the right rows, so the chunk's own attention stays right)."""
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    plan = PageInterleaveKVPoolMixin.__dict__["_get_write_plan"]

    def off_by_one(pool, loc):
        owned, rows = plan(pool, loc)
        if not pool._shard_extend_active:
            return owned, rows
        return owned, rows % pool.size + pool.page_size  # rotated within the real pages

    PageInterleaveKVPoolMixin._get_write_plan = off_by_one
    try:
        yield
    finally:
        PageInterleaveKVPoolMixin._get_write_plan = plan


def _rank(ctx, kv_format_name):
    import sys

    from sglang.srt.mem_cache import memory_pool

    from sglang_cp_hicache.testing.v0_5_23.read_path.batch import ReadPathBatchSpec
    from sglang_cp_hicache.testing.v0_5_23.read_path.formats import KV_FORMATS
    from sglang_cp_hicache.testing.v0_5_23.read_path.kernels import CpuKernelStandIns
    from sglang_cp_hicache.testing.v0_5_23.read_path.rank import read_path_session
    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    (kv_format,) = [f for f in KV_FORMATS if f.name == kv_format_name]
    spec = dataclasses.replace(ReadPathBatchSpec(), extend_lens=CHUNKED_EXTEND_LENS)
    results, counts = {}, {}
    with read_path_session(GlooShardGroup.from_rank_context(ctx), spec, kv_format) as rank:
        flash_mla = sys.modules[CpuKernelStandIns.FLASH_MLA_INTERFACE]
        with counted_calls(flash_mla, FP8_KERNELS, counts), counted_calls(
            memory_pool, ["quantize_k_cache_separate"], counts
        ):
            results["chunked"] = rank.compare_chunked_to_replicated(FIRST_CHUNK_LENS)
        pool = rank.pools.sharded()
        results["pool"] = (pool.dsa_kv_cache_store_fp8, pool.kv_buffer[0].dtype, pool.kv_cache_dim)
        with _chunk_owner_writes_one_page_off():
            results["chunk_writes_off"] = rank.compare_chunked_to_replicated(FIRST_CHUNK_LENS)
    results["counts"] = counts
    return results


@pytest.fixture(
    scope="module",
    params=[
        (2, "flashmla_kv/fp8_e4m3"),
        (3, "flashmla_kv/fp8_e4m3"),
        (2, "flashmla_sparse/bfloat16"),
    ],
    ids=lambda run: f"cp{run[0]}-{run[1].split('/')[0]}",
)
def chunked_results(request):
    cp_size, kv_format_name = request.param
    return cp_size, kv_format_name, run_ranks(cp_size, _rank, kv_format_name)


def test_the_fp8_format_runs_flashmla_kv_over_packed_rows(chunked_results):
    cp_size, kv_format_name, per_rank = chunked_results
    fp8 = kv_format_name.startswith("flashmla_kv")
    for rank, results in enumerate(per_rank):
        store_fp8, dtype, row_dim = results["pool"]
        counts, where = results["counts"], f"cp{cp_size} rank {rank}: {results['counts']}"
        if fp8:
            assert (store_fp8, dtype, row_dim) == (True, torch.uint8, 656), results["pool"]
            # (replicated, sharded) x two chunks x three layers; one schedule per forward
            assert counts.get("flash_mla_with_kvcache") == 2 * 2 * 3, where
            assert counts.get("get_mla_metadata") == 2 * 2, where
            assert counts.get("quantize_k_cache_separate", 0) > 0, where
        else:
            assert (store_fp8, dtype, row_dim) == (False, torch.bfloat16, 48), results["pool"]
            assert not counts, where


def test_chunked_prefill_equals_replicated_bit_for_bit(chunked_results):
    cp_size, kv_format_name, per_rank = chunked_results
    for rank, results in enumerate(per_rank):
        for chunk, comparison in enumerate(results["chunked"]):
            where = f"cp{cp_size} {kv_format_name} rank {rank} chunk {chunk}: {comparison}"
            assert comparison.identical and comparison.table_translated, where
            assert comparison.pool_problems == () and comparison.block_table_problems == (), where
        second = results["chunked"][1].coverage
        # the second chunk selects prefix tokens, among them those the first chunk wrote
        assert second.prefix_selections and second.chunk_selections, second


def test_first_chunk_written_off_by_one_page_breaks_the_second_chunk(chunked_results):
    cp_size, kv_format_name, per_rank = chunked_results
    for rank, results in enumerate(per_rank):
        first, second = results["chunk_writes_off"]
        where = f"cp{cp_size} {kv_format_name} rank {rank}"
        assert first.identical, f"{where}: the chunk's own reads use the scratch stage"
        assert not second.identical and not second.layers[0].attention_equal, where
        assert second.pool_problems, where


# ------------------------------------------------- the reference kernels themselves
def _packed_rows(tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    nope = torch.randn(tokens, 512, generator=gen).to(torch.bfloat16)
    rope = torch.randn(tokens, 64, generator=gen).to(torch.bfloat16)
    nope_part, rope_part = quantize_k_cache_separate_reference(nope, rope)
    return nope, rope, torch.cat([nope_part, rope_part], dim=-1).squeeze(1)


def test_the_quantizer_writes_the_v32_byte_layout():
    nope, rope, packed = _packed_rows(5)
    assert packed.dtype == torch.uint8
    assert packed.shape == (5, packed_row_bytes(512, 64)) == (5, 656)
    scales = packed[:, 512:528].contiguous().view(torch.float32)
    expected = nope.float().reshape(5, 4, 128).abs().amax(dim=-1) / 448.0
    assert torch.equal(scales, expected)
    assert torch.equal(packed[:, 528:].contiguous().view(torch.bfloat16), rope)
    decoded = dequantize_packed_rows(packed, 512)
    assert torch.equal(decoded[:, 512:], rope)
    assert torch.allclose(decoded[:, :512].float(), nope.float(), rtol=0.07, atol=0.02)


def _attend(k_cache, indices, q):
    batch = q.shape[0]
    schedule, splits = get_mla_metadata_reference(
        torch.full((batch,), indices.shape[-1], dtype=torch.int32),
        q.shape[2], 1, q.shape[2], True, indices.shape[-1],
    )  # fmt: skip
    return flash_mla_with_kvcache_reference(
        q, k_cache, torch.empty((batch, 0), dtype=torch.int32), torch.zeros(batch, dtype=torch.int32),
        512, schedule, splits, 0.05, is_fp8_kvcache=True, indices=indices, kv_format="V32",
    )[0]  # fmt: skip


def test_the_flashmla_reference_reads_through_the_block_view():
    blocks = 4
    _, _, packed = _packed_rows(blocks * 64, seed=1)
    k_cache = packed.view(blocks, 64, 1, 656).view(torch.float8_e4m3fn)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(6, 1, 64, 576, generator=gen).to(torch.bfloat16)
    indices = torch.randint(0, blocks * 64, (6, 1, 16), generator=gen, dtype=torch.int32)
    indices[0, 0, 3:] = -1  # invalid entries are skipped
    indices[1, 0, 5] = blocks * 64  # past the cache: invalid too (FlashMLA's rule)
    out = _attend(k_cache, indices, q)

    # independent of the block view: the same rows, decoded flat
    rows = dequantize_packed_rows(packed, 512).float()
    flat = indices[:, 0].long()
    valid = (flat >= 0) & (flat < blocks * 64)
    selected = rows[flat.clamp(0, blocks * 64 - 1)]
    logits = torch.einsum("bhd,btd->bht", q[:, 0].float(), selected) * 0.05
    probs = torch.softmax(logits.masked_fill(~valid[:, None], float("-inf")), dim=-1)
    expected = torch.einsum("bht,btd->bhd", probs, selected[..., :512])
    assert torch.allclose(out[:, 0].float(), expected, atol=2e-2)

    order = torch.tensor([2, 0, 3, 1])  # block b moves to position where(order == b)
    moved = k_cache[order]
    assert not torch.equal(_attend(moved, indices, q), out)  # blocks moved, indices not
    in_cache = (indices >= 0) & (indices < blocks * 64)
    new_block = torch.argsort(order)[indices.long().clamp(0, blocks * 64 - 1) // 64]
    remapped = torch.where(in_cache, (new_block * 64 + indices % 64).int(), indices)
    assert torch.equal(_attend(moved, remapped, q), out)  # both moved: the same reads


def test_the_flashmla_reference_refuses_a_schedule_for_another_batch():
    _, _, packed = _packed_rows(64)
    k_cache = packed.view(1, 64, 1, 656)
    q = torch.zeros(3, 1, 64, 576, dtype=torch.bfloat16)
    indices = torch.zeros(3, 1, 8, dtype=torch.int32)
    schedule, splits = get_mla_metadata_reference(
        torch.ones(2, dtype=torch.int32), 64, 1, 64, True, 8
    )
    with pytest.raises(ValueError, match="schedule made for this batch"):
        flash_mla_with_kvcache_reference(
            q, k_cache, torch.empty((3, 0), dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            512, schedule, splits, is_fp8_kvcache=True, indices=indices, kv_format="V32",
        )  # fmt: skip
    with pytest.raises(NotImplementedError, match="V32 format"):
        flash_mla_with_kvcache_reference(
            q, k_cache, None, None, 512, schedule, splits, is_fp8_kvcache=True, indices=indices
        )
