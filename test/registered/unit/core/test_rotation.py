"""The owner rule (core.rotation, no SGLang): a logical page's lane, a chain's owner of a
position page from its rotation base, the base for an owner, and the lanes of a run,
checked against the rule written out page by page.

The only tests that write the rule out (``(start + k) % lanes``) instead of calling it: an
independent oracle on purpose, for the one place every other site calls."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from sglang_cp_hicache.core.rotation import (
    base_for,
    lane_of,
    lane_page_counts,
    owner_of,
    run_lane_counts,
)

LANES = (1, 2, 3, 4, 8)


def test_a_logical_page_lives_on_its_page_mod_lanes() -> None:
    assert [lane_of(page, 4) for page in range(9)] == [0, 1, 2, 3, 0, 1, 2, 3, 0]


def test_a_chain_lays_its_pages_on_the_lanes_after_its_base() -> None:
    # base 3 over 4 lanes: position pages 0.. land on 3, 0, 1, 2, 3, ...
    assert [owner_of(3, page, 4) for page in range(6)] == [3, 0, 1, 2, 3, 0]


@given(st.sampled_from(LANES), st.integers(0, 63), st.integers(0, 1000))
def test_base_for_inverts_owner_of(lanes: int, owner: int, page: int) -> None:
    base = base_for(owner, page, lanes)
    assert 0 <= base < lanes
    assert owner_of(base, page, lanes) == owner % lanes


@given(st.sampled_from(LANES), st.integers(0, 63), st.integers(0, 40))
def test_run_lane_counts_count_the_runs_pages_per_lane(lanes: int, start: int, pages: int) -> None:
    expected = [0] * lanes
    for k in range(pages):
        expected[(start + k) % lanes] += 1
    assert run_lane_counts(start, pages, lanes) == expected


def test_an_odd_run_puts_its_extra_pages_on_the_lanes_from_its_start() -> None:
    assert run_lane_counts(start_lane=1, pages=6, lanes=4) == [1, 2, 2, 1]


def test_lane_page_counts_count_any_pages() -> None:
    assert lane_page_counts([5, 6, 9, 13, 2], 4) == [0, 3, 2, 0]


@pytest.mark.parametrize("kind", ["tensor", "ndarray"])
def test_arrays_give_the_scalars_answers_elementwise(kind: str) -> None:
    pages = list(range(11))
    array = torch.tensor(pages) if kind == "tensor" else np.array(pages)
    assert lane_of(array, 3).tolist() == [lane_of(p, 3) for p in pages]
    assert owner_of(2, array, 3).tolist() == [owner_of(2, p, 3) for p in pages]
