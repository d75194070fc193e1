"""Tests of CPSharedPagedTokenToKVPoolAllocator.alloc_pages_with_owners (HiCache load-back)."""

from typing import List

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (
    CPSharedPagedTokenToKVPoolAllocator,
)
from sglang_cp_hicache.testing.v0_5_12.allocators import build_cp_allocator

CP_SIZES = (1, 2, 3, 4, 8)
PAGE_SIZES = (1, 16, 64)


make_allocator = build_cp_allocator


def lane_lists(allocator: CPSharedPagedTokenToKVPoolAllocator) -> List[List[int]]:
    return [t.tolist() for t in allocator.lanes.free_pages + allocator.lanes.release_pages]


@st.composite
def allocator_and_owners(draw):
    cp_size = draw(st.sampled_from(CP_SIZES))
    page_size = draw(st.sampled_from(PAGE_SIZES))
    owners = draw(st.lists(st.integers(0, cp_size - 1), max_size=24))
    return cp_size, page_size, owners


@settings(max_examples=60, deadline=None)
@given(allocator_and_owners(), st.booleans())
def test_owner_sequence_preserved_and_pages_contiguous(params, need_sort):
    cp_size, page_size, owners = params
    allocator = make_allocator(cp_size, page_size, pages_per_lane=24, need_sort=need_sort)

    locs = allocator.alloc_pages_with_owners(owners)

    assert locs is not None and locs.dtype == torch.int64
    assert len(locs) == len(owners) * page_size
    assert allocator.layout.page_owners_of_locs(locs).tolist() == owners
    by_page = locs.view(-1, page_size)
    assert torch.equal(by_page - by_page[:, :1], torch.arange(page_size).expand_as(by_page))
    assert bool((by_page[:, 0] % page_size == 0).all())
    pages = by_page[:, 0] // page_size
    assert len(torch.unique(pages)) == len(pages)
    assert bool((pages >= cp_size).all())  # never the padding page of any rank
    assert allocator.available_size() == allocator.size - len(owners) * page_size


@settings(max_examples=40, deadline=None)
@given(allocator_and_owners())
def test_input_kinds_give_identical_locs_on_every_rank(params):
    cp_size, page_size, owners = params
    inputs = [owners, np.array(owners, dtype=np.int8), torch.tensor(owners, dtype=torch.int8)]
    results = []
    for rank in range(cp_size):
        for owner_input in inputs:
            allocator = make_allocator(cp_size, page_size, pages_per_lane=24, cp_rank=rank)
            results.append(allocator.alloc_pages_with_owners(owner_input))
    for result in results[1:]:
        assert torch.equal(result, results[0])


@settings(max_examples=60, deadline=None)
@given(allocator_and_owners(), st.integers(1, 4), st.booleans())
def test_exhausted_lane_fails_cleanly_and_recovers_after_targeted_free(
    params, pages_per_lane, need_sort
):
    cp_size, page_size, owners = params
    # Keep each lane's demand within its capacity so freeing can satisfy it.
    owners = [o for i, o in enumerate(owners) if owners[: i + 1].count(o) <= pages_per_lane]
    allocator = make_allocator(cp_size, page_size, pages_per_lane, need_sort=need_sort)
    filler = allocator.alloc(allocator.available_size())
    before = lane_lists(allocator)
    expected_deficit = allocator.lane_deficit(allocator.lane_demand(np.array(owners, dtype=np.int64)))
    assert expected_deficit == np.bincount(np.array(owners, dtype=np.int64), minlength=cp_size).tolist()

    result = allocator.alloc_pages_with_owners(owners)

    if not owners:
        assert result is not None and len(result) == 0
        return
    assert result is None
    assert lane_lists(allocator) == before
    assert allocator.available_size() == 0
    # Free exactly the deficit, lane by lane, from the filler allocation.
    filler_pages = filler.view(-1, page_size)
    filler_lanes = allocator.layout.page_owners_of_locs(filler)
    for lane, missing in enumerate(expected_deficit):
        rows = torch.nonzero(filler_lanes == lane, as_tuple=True)[0][:missing]
        allocator.free(filler_pages[rows].reshape(-1))
    locs = allocator.alloc_pages_with_owners(owners)
    assert locs is not None
    assert allocator.layout.page_owners_of_locs(locs).tolist() == owners
    assert allocator.available_size() == 0


def test_partial_deficit_reports_only_short_lanes():
    allocator = make_allocator(cp_size=4, page_size=64, pages_per_lane=2)
    assert allocator.alloc_pages_with_owners([2, 2, 3]) is not None

    owners = np.array([2, 3, 3, 0, 0, 0])
    assert allocator.lane_deficit(allocator.lane_demand(owners)) == [1, 0, 1, 1]
    assert allocator.alloc_pages_with_owners(owners) is None
    assert allocator.lane_available_pages().tolist() == [2, 2, 0, 1]


def test_matches_logical_pages_of_freed_node_after_reload():
    """HiCache round trip: evict a node, reload it, the owner pattern is the same."""
    allocator = make_allocator(cp_size=4, page_size=64, pages_per_lane=8)
    node_locs = allocator.alloc_extend(
        torch.tensor([0]),
        torch.tensor([0]),
        torch.tensor([300]),
        torch.tensor([300]),
        torch.tensor([-1]),
        300,
    )
    page_owners = allocator.layout.page_owners_of_locs(node_locs).to(torch.int8)
    allocator.free(node_locs)

    reloaded = allocator.alloc_pages_with_owners(page_owners)

    assert torch.equal(allocator.layout.page_owners_of_locs(reloaded), page_owners.long())
    assert len(reloaded) == len(page_owners) * 64


@pytest.mark.parametrize("bad_owner", [-1, 4])
def test_rejects_out_of_range_owner(bad_owner):
    allocator = make_allocator(cp_size=4, page_size=16, pages_per_lane=4)
    before = lane_lists(allocator)

    with pytest.raises(ValueError):
        allocator.alloc_pages_with_owners([0, bad_owner])
    assert lane_lists(allocator) == before
