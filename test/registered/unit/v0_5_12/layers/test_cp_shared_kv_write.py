"""Write path: logical out_cache_loc -> physical locs (owned) / padding page (not owned)."""

import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_write import (
    WritePathLocs,
    translate_out_cache_loc,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout


@pytest.mark.parametrize("cp_size", [2, 4])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_owned_locs_go_to_physical_and_others_to_padding_page(cp_size, dtype):
    page_size = 4
    logical = torch.arange(cp_size * page_size, cp_size * page_size * 6, dtype=dtype)
    for rank in range(cp_size):
        layout = CpSharedKVLayout(cp_size, rank, page_size)
        physical = translate_out_cache_loc(layout, logical)
        assert physical.dtype == dtype and physical.shape == logical.shape
        owned = layout.owned_mask(logical)
        assert torch.equal(physical[owned], layout.logical_locs_to_physical(logical[owned]))
        # Non-owned tokens hit the reserved padding page, same offset in the page.
        assert torch.equal(physical[~owned], logical[~owned] % page_size)
        assert bool((physical[owned] >= page_size).all())


def test_every_token_is_written_by_exactly_one_rank():
    cp_size, page_size = 4, 64
    logical = torch.randperm(10_000)[:777] + cp_size * page_size
    writers = torch.zeros_like(logical)
    for rank in range(cp_size):
        physical = translate_out_cache_loc(CpSharedKVLayout(cp_size, rank, page_size), logical)
        writers += (physical >= page_size).long()
    assert bool((writers == 1).all())


def test_write_path_locs_keep_the_logical_tensor():
    layout = CpSharedKVLayout(2, 1, 4)
    logical = torch.arange(8, 40)
    locs = WritePathLocs.build(layout, logical)
    assert locs.logical is logical
    assert torch.equal(locs.physical, translate_out_cache_loc(layout, logical))
