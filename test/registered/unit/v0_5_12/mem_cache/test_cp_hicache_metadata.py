"""CpHiCacheNodeMetadata, PageRun and CpHostPageTable: the host tier's translation."""

import numpy as np
import pytest
import torch

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import (
    CpHiCacheMetadataError,
    CpHiCacheNodeMetadata,
    CpHostPageTable,
    PageRun,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout, page_token_locs

PS = 4


def _metadata(page_owners, cp_rank, logical_len=None, host_base=100):
    page_owners = torch.tensor(page_owners, dtype=torch.int64)
    logical_len = len(page_owners) * PS if logical_len is None else logical_len
    positions = torch.arange(logical_len)
    owned = positions[page_owners[positions // PS] == cp_rank]
    return CpHiCacheNodeMetadata(
        logical_len=logical_len,
        owned_positions=owned,
        host_indices=host_base + torch.arange(len(owned)),
        page_owners=page_owners,
        page_size=PS,
        node_id=7,
        cp_rank=cp_rank,
    )


def test_split_page_aligned_masks_positions_not_slices():
    meta = _metadata([1, 0, 1, 0], cp_rank=0)  # owns positions 4..7 and 12..15
    parent, child = meta.split(8)
    assert parent.logical_len == 8 and child.logical_len == 8
    assert parent.owned_positions.tolist() == [4, 5, 6, 7]
    assert parent.host_indices.tolist() == [100, 101, 102, 103]
    assert child.owned_positions.tolist() == [4, 5, 6, 7]  # 12..15 rebased
    assert child.host_indices.tolist() == [104, 105, 106, 107]
    assert parent.page_owners.tolist() == [1, 0] and child.page_owners.tolist() == [1, 0]


def test_split_at_zero():
    meta = _metadata([0, 1], cp_rank=0)
    parent, child = meta.split(0)
    assert parent.logical_len == 0 and parent.owned_len == 0 and len(parent.page_owners) == 0
    assert child.logical_len == meta.logical_len
    assert torch.equal(child.owned_positions, meta.owned_positions)
    assert torch.equal(child.host_indices, meta.host_indices)


def test_split_with_no_owned_positions_on_this_rank():
    meta = _metadata([1, 1, 1], cp_rank=0)
    parent, child = meta.split(PS)
    assert meta.owned_len == parent.owned_len == child.owned_len == 0
    assert parent.logical_len + child.logical_len == meta.logical_len
    assert child.page_owners.tolist() == [1, 1]


def test_split_with_owned_positions_on_both_sides():
    meta = _metadata([2, 0, 1, 2, 2], cp_rank=2)
    parent, child = meta.split(2 * PS)
    assert parent.owned_positions.tolist() == [0, 1, 2, 3]
    assert child.owned_positions.tolist() == list(range(PS, 3 * PS))
    assert torch.equal(torch.cat([parent.host_indices, child.host_indices]), meta.host_indices)


@pytest.mark.parametrize("bad", [-1, 4 * PS + 1, PS + 1])
def test_invalid_split_raises_with_node_and_rank(bad):
    meta = _metadata([0, 1, 0, 1], cp_rank=1)
    with pytest.raises(CpHiCacheMetadataError, match="node 7 on CP rank 1"):
        meta.split(bad)


def test_split_of_valid_tail_node():
    meta = _metadata([0, 1, 0], cp_rank=0, logical_len=2 * PS + 1)  # tail page holds 1 token
    parent, child = meta.split(2 * PS)
    assert child.logical_len == 1 and child.owned_positions.tolist() == [0]
    assert parent.split(2 * PS)[1].logical_len == 0


@pytest.mark.parametrize(
    "mutate, reason",
    [
        (lambda m: setattr(m, "host_indices", m.host_indices[:-1]), "host indices"),
        (lambda m: setattr(m, "owned_positions", m.owned_positions.flip(0)), "increasing"),
        (lambda m: setattr(m, "owned_positions", m.owned_positions.to(torch.int32)), "int64"),
        (lambda m: setattr(m, "owned_positions", m.owned_positions + PS), "another rank"),
        (lambda m: setattr(m, "page_owners", m.page_owners[:-1]), "page owners"),
    ],
)
def test_malformed_metadata_fails_fast(mutate, reason):
    meta = _metadata([0, 1, 0, 1], cp_rank=0)
    fields = dict(meta.__dict__)
    shadow = type("Shadow", (), {})()
    shadow.__dict__.update(fields)
    mutate(shadow)
    with pytest.raises(CpHiCacheMetadataError, match=reason):
        CpHiCacheNodeMetadata(**shadow.__dict__)


def _table(cp_size=2, cp_rank=0, physical_pages=4):
    return CpHostPageTable(CpSharedKVLayout(cp_size, cp_rank, PS), physical_pages)


def test_host_table_admission_is_per_lane_and_rank_invariant():
    tables = [_table(cp_rank=r) for r in range(2)]
    # Logical device pages 2..7 (owners 0,1,0,1,0,1), then lane 0 heavy: 8, 10, 12.
    first = PageRun.of(page_token_locs(np.arange(2, 8), PS), PS)
    lane0_heavy = PageRun.of(page_token_locs(np.array([8, 10]), PS), PS)
    for table in tables:
        plan = table.plan_write(first)
        assert plan.lane_pages == [3, 3]
        assert not any(table.lane_deficit(plan.lane_pages))
        owned_count = plan.lane_pages[table.layout.cp_rank]
        table.commit_write(plan, np.arange(owned_count))
        assert table.lane_deficit(table.plan_write(lane0_heavy).lane_pages) == [1, 0]
    assert [t.lane_used_pages() for t in tables] == [[3, 3], [3, 3]]


def test_host_table_metadata_release_round_trip():
    table = _table(cp_size=3, cp_rank=1, physical_pages=5)
    device_locs = page_token_locs(np.array([4, 5, 6, 7]), PS)[: 3 * PS + 2]  # valid tail
    plan = table.plan_write(PageRun.of(device_locs, PS))
    assert plan.page_owners.tolist() == [1, 2, 0, 1]
    host_locs = table.commit_write(plan, np.array([3, 0]))
    # Logical host pages 0..3, each loc at its device loc's in-page offset.
    assert host_locs.tolist() == list(range(3 * PS + 2))
    meta = table.node_metadata(torch.from_numpy(host_locs), node_id=11)
    assert meta.logical_len == 3 * PS + 2
    assert meta.owned_positions.tolist() == [0, 1, 2, 3, 12, 13]
    assert meta.host_indices.tolist() == [12, 13, 14, 15, 0, 1]
    assert table.lane_pages(host_locs) == [1, 2, 1]
    # The load plan carries this rank's physical host slots, whole pages (the tail too).
    plan = table.plan_load(host_locs, node_id=11)
    assert plan.owned_host_locs.tolist() == list(range(12, 16)) + list(range(0, 4))
    physical, lane_freed = table.release(host_locs, node_id=11)
    assert sorted(physical.tolist()) == [0, 3] and lane_freed == [1, 2, 1]
    assert table.used_logical_tokens() == 0 and not any(table.lane_used_pages())
    with pytest.raises(CpHiCacheMetadataError, match="node 11 on CP rank 1"):
        table.release(host_locs, node_id=11)


@pytest.mark.parametrize(
    "locs,page_of_loc",
    [
        (page_token_locs(np.array([9, 2, 5]), PS), None),  # whole pages in order
        (page_token_locs(np.array([9, 2]), PS)[: PS + 1], [0, 0, 0, 0, 1]),  # valid tail
        (np.array([37, 38, 8, 9, 10, 11]), [0, 0, 1, 1, 1, 1]),  # starts mid-page
    ],
)
def test_page_run_finds_pages_in_order_and_relocates_offsets(locs, page_of_loc):
    run = PageRun.of(locs, PS)
    expected_pages = [int(p) for i, p in enumerate(locs // PS) if i == 0 or p != locs[i - 1] // PS]
    assert run.pages.tolist() == expected_pages
    assert (run.page_of_loc is None) == (page_of_loc is None)
    if page_of_loc is not None:
        assert run.page_of_loc.tolist() == page_of_loc
    new_pages = np.arange(100, 100 + len(run.pages))
    moved = run.relocate(new_pages)
    assert (moved % PS).tolist() == (locs % PS).tolist()
    assert (moved // PS).tolist() == [100 + expected_pages.index(p) for p in (locs // PS).tolist()]
    head, tail = run.split(PS)
    assert head.locs.tolist() + tail.locs.tolist() == locs.tolist()


@pytest.mark.parametrize("cp_rank,physical_pages", [(0, []), (1, [3, 1]), (2, [4])])
def test_load_plan_owned_host_locs_are_the_physical_pages_commit_recorded(cp_rank, physical_pages):
    """Owned in part, or not at all: the plan's slots are the physical pages commit_write
    recorded for this rank's pages, whole and in page order (empty on a rank owning none)."""
    table = _table(cp_size=3, cp_rank=cp_rank, physical_pages=5)
    device_locs = page_token_locs(np.array([4, 7, 5]), PS)  # owners 1, 1, 2 at cp 3
    plan = table.plan_write(PageRun.of(device_locs, PS))
    host_locs = table.commit_write(plan, np.array(physical_pages, dtype=np.int64))
    load_plan = table.plan_load(host_locs)
    assert load_plan.lane_pages == [0, 2, 1]
    assert load_plan.owned_host_locs.dtype == np.int64
    expected = page_token_locs(np.array(physical_pages, dtype=np.int64), PS)
    assert load_plan.owned_host_locs.tolist() == expected.tolist()
