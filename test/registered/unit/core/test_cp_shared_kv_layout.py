"""Property tests of CpSharedKVLayout: logical <-> physical page ownership.

The owner rule is written out here (``page % cp_size``) instead of calling
``core.rotation.lane_of``: an independent oracle of the layout on purpose."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

CP_SIZES = (1, 2, 3, 4, 8)
PAGE_SIZES = (1, 16, 64)
MAX_PHYSICAL_PAGES = 40

layout_params = st.tuples(st.sampled_from(CP_SIZES), st.sampled_from(PAGE_SIZES))


@st.composite
def layout_and_logical_locs(draw):
    cp_size, page_size = draw(layout_params)
    cp_rank = draw(st.integers(0, cp_size - 1))
    max_loc = (MAX_PHYSICAL_PAGES + 1) * cp_size * page_size
    locs = draw(st.lists(st.integers(0, max_loc - 1), min_size=0, max_size=64))
    return CpSharedKVLayout(cp_size, cp_rank, page_size), np.array(locs, dtype=np.int64)


def _owned_logical_locs(layout: CpSharedKVLayout) -> np.ndarray:
    """Every logical loc whose page this rank stores, physical pages 0..MAX."""
    physical_locs = np.arange((MAX_PHYSICAL_PAGES + 1) * layout.page_size, dtype=np.int64)
    return layout.physical_locs_to_logical(physical_locs)


def _assert_same(torch_result: torch.Tensor, numpy_result: np.ndarray) -> None:
    assert isinstance(torch_result, torch.Tensor)
    assert isinstance(numpy_result, np.ndarray)
    np.testing.assert_array_equal(torch_result.numpy(), numpy_result)


@settings(max_examples=60, deadline=None)
@given(layout_params, st.data())
def test_logical_physical_bijection_on_every_rank(params, data):
    cp_size, page_size = params
    cp_rank = data.draw(st.integers(0, cp_size - 1))
    layout = CpSharedKVLayout(cp_size, cp_rank, page_size)
    physical_locs = torch.arange((MAX_PHYSICAL_PAGES + 1) * page_size)

    logical_locs = layout.physical_locs_to_logical(physical_locs)

    assert torch.equal(layout.logical_locs_to_physical(logical_locs), physical_locs)
    assert bool(layout.owned_mask(logical_locs).all())
    assert len(torch.unique(logical_locs)) == len(logical_locs)
    logical_pages = logical_locs[::page_size] // page_size
    assert torch.equal(logical_pages % cp_size, torch.full_like(logical_pages, cp_rank))
    assert torch.equal(
        layout.logical_pages_to_physical(logical_pages), physical_locs[::page_size] // page_size
    )
    # Offsets within a page are preserved both ways.
    assert torch.equal(logical_locs % page_size, physical_locs % page_size)


@settings(max_examples=40, deadline=None)
@given(layout_params)
def test_ranks_tile_the_logical_space(params):
    cp_size, page_size = params
    layouts = [CpSharedKVLayout(cp_size, rank, page_size) for rank in range(cp_size)]
    covered = np.concatenate([_owned_logical_locs(layout) for layout in layouts])

    np.testing.assert_array_equal(
        np.sort(covered), np.arange((MAX_PHYSICAL_PAGES + 1) * cp_size * page_size)
    )
    # Physical page 0 (padding) of rank r is logical page r.
    for layout in layouts:
        assert layout.physical_pages_to_logical(np.array([0]))[0] == layout.cp_rank


@settings(max_examples=60, deadline=None)
@given(layout_and_logical_locs())
def test_owned_masks_of_all_ranks_partition_locs(layout_and_locs):
    layout, locs = layout_and_locs
    masks = [
        CpSharedKVLayout(layout.cp_size, rank, layout.page_size).owned_mask(locs)
        for rank in range(layout.cp_size)
    ]
    np.testing.assert_array_equal(np.sum(masks, axis=0), np.ones(len(locs)))
    np.testing.assert_array_equal(
        layout.owner_for_logical_locs(locs), (locs // layout.page_size) % layout.cp_size
    )


@settings(max_examples=60, deadline=None)
@given(layout_and_logical_locs())
def test_torch_and_numpy_agree(layout_and_locs):
    layout, locs = layout_and_locs
    locs_t = torch.from_numpy(locs)
    pages = locs // layout.page_size

    _assert_same(
        layout.owner_for_logical_pages(torch.from_numpy(pages)),
        layout.owner_for_logical_pages(pages),
    )
    _assert_same(layout.owner_for_logical_locs(locs_t), layout.owner_for_logical_locs(locs))
    _assert_same(layout.owned_mask(locs_t), layout.owned_mask(locs))
    _assert_same(layout.owned_positions(locs_t), layout.owned_positions(locs))
    _assert_same(layout.page_owners_of_locs(locs_t), layout.page_owners_of_locs(locs))
    _assert_same(layout.physical_locs_to_logical(locs_t), layout.physical_locs_to_logical(locs))
    _assert_same(
        layout.physical_pages_to_logical(torch.from_numpy(pages)),
        layout.physical_pages_to_logical(pages),
    )

    owned = locs[layout.owned_mask(locs)]
    owned_pages = owned // layout.page_size
    _assert_same(
        layout.logical_locs_to_physical(torch.from_numpy(owned)),
        layout.logical_locs_to_physical(owned),
    )
    _assert_same(
        layout.logical_pages_to_physical(torch.from_numpy(owned_pages)),
        layout.logical_pages_to_physical(owned_pages),
    )
    assert layout.owned_positions(locs_t).dtype == torch.int64
    assert layout.owned_positions(locs).dtype == np.int64


@settings(max_examples=60, deadline=None)
@given(layout_and_logical_locs())
def test_owned_positions_select_owned_entries(layout_and_locs):
    layout, locs = layout_and_locs
    positions = layout.owned_positions(locs)

    np.testing.assert_array_equal(locs[positions], locs[layout.owned_mask(locs)])
    assert np.all(np.diff(positions) > 0)


@settings(max_examples=60, deadline=None)
@given(layout_and_logical_locs())
def test_non_owned_loc_raises(layout_and_locs):
    layout, locs = layout_and_locs
    not_owned = locs[~layout.owned_mask(locs)]
    if len(not_owned) == 0:
        return
    mixed = np.concatenate([locs[layout.owned_mask(locs)], not_owned[:1]])

    for values in (mixed, torch.from_numpy(mixed)):
        with pytest.raises(ValueError):
            layout.logical_locs_to_physical(values)
        with pytest.raises(ValueError):
            layout.logical_pages_to_physical(values // layout.page_size)
    # validate=False is the no-host-sync path used for device tensors.
    layout.logical_locs_to_physical(torch.from_numpy(mixed), validate=False)


def test_device_tensors_are_not_validated_by_default():
    layout = CpSharedKVLayout(cp_size=2, cp_rank=0, page_size=4)
    not_owned = torch.tensor([4], device="meta")  # any non-CPU device

    result = layout.logical_locs_to_physical(not_owned)

    assert result.device.type == "meta"
    assert result.shape == not_owned.shape


@settings(max_examples=40, deadline=None)
@given(layout_params, st.lists(st.integers(0, 100), min_size=0, max_size=12), st.integers(0, 64))
def test_page_owners_of_page_aligned_run(params, logical_pages, tail):
    cp_size, page_size = params
    layout = CpSharedKVLayout(cp_size, 0, page_size)
    pages = torch.tensor(logical_pages, dtype=torch.int64)
    run = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)
    run = run[: max(len(run) - tail % page_size, 0)]  # a trailing partial page still counts

    owners = layout.page_owners_of_locs(run)

    expected = pages[: (len(run) + page_size - 1) // page_size] % cp_size
    assert torch.equal(owners, expected)


@pytest.mark.parametrize(
    "cp_size, cp_rank, page_size",
    [(0, 0, 64), (2, 2, 64), (2, -1, 64), (2, 0, 0)],
)
def test_invalid_layout_rejected(cp_size, cp_rank, page_size):
    with pytest.raises(ValueError):
        CpSharedKVLayout(cp_size, cp_rank, page_size)


def test_cp4_page64_example_from_docs():
    layout = CpSharedKVLayout(cp_size=4, cp_rank=2, page_size=64)
    logical_locs = np.array([6 * 64 + 5, 10 * 64])  # logical pages 6 and 10 live on rank 2

    np.testing.assert_array_equal(
        layout.logical_locs_to_physical(logical_locs), [1 * 64 + 5, 2 * 64]
    )
    np.testing.assert_array_equal(
        layout.physical_locs_to_logical(np.array([64 + 5, 128])), logical_locs
    )
    np.testing.assert_array_equal(
        layout.owner_for_logical_pages(np.arange(8)), [0, 1, 2, 3, 0, 1, 2, 3]
    )
