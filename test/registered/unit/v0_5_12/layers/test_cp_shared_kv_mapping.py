"""Batch mapping: dense layout, owner plan, device-side remap of logical locs/pages."""

import numpy as np
import torch

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import (
    build_batch_mapping,
    read_request_logical_pages,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

PAGE = 4


def _mapping(cp_size=2, rank=0, pages=None, prefix_lens=(9, 5)):
    pages = pages or [np.array([12, 7, 9]), np.array([12, 30])]
    return build_batch_mapping(CpSharedKVLayout(cp_size, rank, PAGE), pages, prefix_lens, "cpu")


def test_dense_layout_is_padding_then_prefix_by_owner_then_chunk_only_pages():
    # request 0: prefix 9 tokens -> pages 12, 7, 9 (3 pages); request 1: prefix 5 -> 12, 30
    mapping = _mapping(pages=[np.array([12, 7, 9, 40]), np.array([12, 30, 3])], prefix_lens=(9, 5))
    assert mapping.sorted_logical_pages.tolist() == [3, 7, 9, 12, 30, 40]
    assert mapping.num_dense_pages == 7
    plan = mapping.plan
    assert [p.tolist() for p in plan.owner_logical_pages] == [[12, 30], [7, 9]]
    assert plan.dense_starts == (1, 3) and plan.prefix_dense_range == slice(1, 5)
    assert plan.max_owned == 2 and plan.num_prefix_pages == 4
    pages = torch.tensor([[12, 30, 7, 9, 3, 40, 5]])
    assert mapping.remap_logical_pages(pages).tolist() == [[1, 2, 3, 4, 5, 6, 0]]


def test_remap_locs_keeps_the_offset_and_sends_unknown_pages_to_padding():
    mapping = _mapping()
    locs = torch.tensor([12 * PAGE + 3, 7 * PAGE, 30 * PAGE + 1, 99 * PAGE + 2], dtype=torch.int32)
    dense = mapping.remap_logical_locs(locs)
    assert dense.dtype == torch.int32
    assert dense.tolist() == [1 * PAGE + 3, 3 * PAGE, 2 * PAGE + 1, 2]


def test_local_pages_are_this_ranks_physical_pages_in_dense_order():
    mapping = _mapping(cp_size=2, rank=1)
    assert mapping.local_physical_pages.tolist() == [3, 4]  # 7 // 2, 9 // 2
    assert mapping.local_dense_range == slice(3, 5)


def test_pages_holding_only_current_chunk_tokens_are_not_materialised():
    mapping = _mapping(pages=[np.array([12, 7, 9])], prefix_lens=(4,))
    assert mapping.plan.num_prefix_pages == 1
    assert mapping.remap_logical_pages(torch.tensor([12, 7, 9])).tolist() == [1, 2, 3]


def test_mapping_is_identical_on_every_rank_but_the_local_part():
    mappings = [_mapping(cp_size=4, rank=r) for r in range(4)]
    for m in mappings[1:]:
        assert torch.equal(m.dense_of_sorted, mappings[0].dense_of_sorted)
        assert m.plan.dense_starts == mappings[0].plan.dense_starts
    ranges = [m.local_dense_range for m in mappings]
    assert [r.start for r in ranges[1:]] == [r.stop for r in ranges[:-1]]
    assert ranges[0].start == 1 and ranges[-1].stop == 1 + mappings[0].plan.num_prefix_pages


def test_batch_without_prefix_or_pages():
    mapping = _mapping(pages=[np.array([], dtype=np.int64)], prefix_lens=(0,))
    assert mapping.num_dense_pages == 1 and mapping.plan.max_owned == 0
    assert mapping.remap_logical_pages(torch.tensor([5, 6])).tolist() == [0, 0]


def test_read_request_logical_pages_reads_page_starts_up_to_each_length():
    req_to_token = torch.zeros(4, 32, dtype=torch.int32)
    req_to_token[2, :10] = torch.tensor([5, 6, 7, 4]).repeat_interleave(PAGE)[:10] * PAGE + torch.arange(10) % PAGE
    req_to_token[0, :3] = 9 * PAGE + torch.arange(3)
    pages = read_request_logical_pages(req_to_token, torch.tensor([2, 0]), [10, 3], PAGE)
    assert [p.tolist() for p in pages] == [[5, 6, 7], [9]]
