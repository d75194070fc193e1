"""The CPU server runtime's torch ports of the DSA kernels (``testing/server/dsa_kernels.py``)
against the project's reference indexer math and page layout (``testing/reference_sparse_mla``:
``sum_h gate_h * relu(q_h . k)`` over dequantized keys, keys and scales packed per page as
``SetKAndS`` writes them). Runs in both venvs."""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.testing.reference_sparse_mla import dequantize_index_k, quantize_index_k, write_index_k
from sglang_cp_hicache.testing.server import dsa_kernels

PAGE = 64
HEADS = 4
DIM = 128


def _reference_logits(q_fp8: torch.Tensor, gates: torch.Tensor, k_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    keys = dequantize_index_k(k_fp8.view(torch.uint8), scale.reshape(-1, 1).contiguous().view(torch.uint8))
    scores = torch.relu(torch.einsum("mhd,nd->mhn", q_fp8.float(), keys))
    return (scores * gates[:, :, None]).sum(dim=1)


def _assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    # float32 sums in another order: heads' signed gates cancel, so compare to the scale
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def _inputs(seed: int, rows: int, keys: int):
    g = torch.Generator().manual_seed(seed)
    q, _ = dsa_kernels.act_quant(torch.randn(rows, HEADS, DIM, generator=g).to(torch.bfloat16))
    k_fp8, scale = quantize_index_k(torch.randn(keys, DIM, generator=g))
    gates = torch.randn(rows, HEADS, generator=g)
    return q, gates, k_fp8, scale.reshape(-1)


def test_mqa_logits_match_the_reference_indexer_inside_each_rows_range():
    q, gates, k_fp8, scale = _inputs(0, rows=5, keys=40)
    ks = torch.tensor([0, 0, 3, 10, 20], dtype=torch.int32)
    ke = torch.tensor([1, 12, 30, 40, 21], dtype=torch.int32)
    got = dsa_kernels.mqa_logits(q, k_fp8, scale, gates, ks, ke)
    want = _reference_logits(q, gates, k_fp8, scale)
    for row in range(5):
        inside = slice(int(ks[row]), int(ke[row]))
        _assert_close(got[row, inside], want[row, inside])
        outside = torch.ones(40, dtype=torch.bool)
        outside[inside] = False
        assert torch.isinf(got[row, outside]).all() and (got[row, outside] < 0).all()


def test_paged_logits_read_each_requests_keys_through_its_block_table():
    q, gates, k_fp8, scale = _inputs(1, rows=2, keys=3 * PAGE)
    buffer = torch.zeros(8, PAGE * (DIM + 4), dtype=torch.uint8)
    # request 0 holds the keys on pages 5, 2, 7; request 1 its first 70 keys on pages 1, 6
    write_index_k(buffer, torch.tensor([5, 2, 7]).repeat_interleave(PAGE) * PAGE + torch.arange(3 * PAGE) % PAGE, k_fp8, scale[:, None], PAGE)
    tables = torch.tensor([[5, 2, 7], [5, 2, 0]], dtype=torch.int32)
    lengths = torch.tensor([3 * PAGE, 70], dtype=torch.int32)
    got = dsa_kernels.paged_mqa_logits(q, buffer, gates, lengths, tables, PAGE, max_len=3 * PAGE)
    want = _reference_logits(q, gates, k_fp8, scale)
    _assert_close(got[0], want[0])
    _assert_close(got[1, :70], want[1, :70])
    assert torch.isinf(got[1, 70:]).all()


def test_index_k_pages_reads_keys_then_scales_of_each_page():
    k_fp8, scale = quantize_index_k(torch.randn(2 * PAGE, DIM))
    buffer = torch.zeros(4, PAGE * (DIM + 4), dtype=torch.uint8)
    write_index_k(buffer, torch.arange(2 * PAGE) + 2 * PAGE, k_fp8, scale, PAGE)  # pages 2, 3
    keys, scales = dsa_kernels.index_k_pages(buffer, torch.tensor([3, 2]), PAGE)
    assert torch.equal(keys.view(torch.uint8), torch.cat([k_fp8[PAGE:], k_fp8[:PAGE]]).view(torch.uint8))
    assert torch.equal(scales, torch.cat([scale[PAGE:], scale[:PAGE]]).reshape(-1))


def test_act_quant_blocks_floor_and_ue8m0_scales():
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0)) * 5
    x[1, :128] = 0.0  # an all-zero block takes the 1e-4 amax floor, as the Triton kernel does
    y, scale = dsa_kernels.act_quant(x)
    assert y.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    assert scale[1, 0] == pytest.approx(1e-4 / 448.0)
    block_scale = scale.repeat_interleave(128, dim=1)
    back = y.float() * block_scale
    # e4m3 rounding: half a step of 3 mantissa bits (2^-4 relative) for normals, half the
    # subnormal step (2^-10 of the block's scale) near zero.
    assert ((back - x).abs() <= x.abs() * 2**-4 + block_scale * 2**-10).all()
    _, rounded = dsa_kernels.act_quant(x, scale_fmt="ue8m0")
    assert torch.equal(torch.exp2(torch.log2(rounded).round()), rounded)  # powers of two
    assert (rounded >= scale).all() and (rounded < 2 * scale).all()  # rounded up, by < 2x


def test_act_quant_refuses_what_the_kernel_refuses():
    with pytest.raises(ValueError, match="contiguous"):
        dsa_kernels.act_quant(torch.randn(256, 4).t())
    with pytest.raises(ValueError, match="block"):
        dsa_kernels.act_quant(torch.randn(2, 100))


def test_hadamard_rotation_is_orthonormal_and_sylvester_ordered():
    x = torch.randn(6, 128)
    rotated = dsa_kernels.hadamard_rotate(x)
    torch.testing.assert_close(rotated.norm(dim=-1), x.norm(dim=-1), rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(dsa_kernels.hadamard_rotate(rotated), x, rtol=1e-5, atol=1e-5)  # H is its own inverse
    e1 = torch.zeros(1, 4)
    e1[0, 1] = 1.0
    torch.testing.assert_close(dsa_kernels.hadamard_rotate(e1), torch.tensor([[0.5, -0.5, 0.5, -0.5]]))
    with pytest.raises(ValueError, match="power of 2"):
        dsa_kernels.hadamard_rotate(torch.randn(2, 96))


def test_decode_page_table_transform_maps_selected_positions_and_keeps_minus_one():
    table = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]], dtype=torch.int32)
    topk = torch.tensor([[3, 0, -1], [-1, 2, 1]], dtype=torch.int32)
    out = torch.empty(2, 3, dtype=torch.int32)
    assert dsa_kernels.transform_index_page_table_decode(table, topk, result=out) is out
    assert out.tolist() == [[13, 10, -1], [-1, 22, 21]]
    with pytest.raises(ValueError, match="page_size"):
        dsa_kernels.transform_index_page_table_decode(table, topk, page_size=64)


def test_seqlens_expand_gives_each_query_the_keys_up_to_itself():
    # request 0: 3 new tokens over 10 keys (queries see 8, 9, 10); request 1: 2 over 5; a
    # padded row with fewer keys than queries floors at 0, as the Triton kernel does
    got = dsa_kernels.seqlens_expand(torch.tensor([3, 2, 2]), torch.tensor([10, 5, 0]), 7, 3)
    assert got.dtype == torch.int32 and got.tolist() == [8, 9, 10, 4, 5, 0, 0]
    with pytest.raises(ValueError, match="total_len"):
        dsa_kernels.seqlens_expand(torch.tensor([3]), torch.tensor([10]), 4, 3)
