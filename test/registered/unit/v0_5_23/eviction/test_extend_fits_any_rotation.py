"""The lane-aware extend's fast path (``lane_eviction.fits_any_rotation``): a batch of
continuing chains whose draws every lane holds at any rotation skips the per-lane
simulation and keeps upstream's bases. Checked against the simulation itself
(``core.lane_eviction``) over every small case: wherever the bound says "fits", no rotation
leaves a lane short, so the room made (none) and the bases (the given ones) are what the
full path (``DeviceLaneEvictor.make_extend_room``) decides."""

from __future__ import annotations

import itertools
from types import SimpleNamespace
from typing import List

import pytest

from sglang_cp_hicache.core.lane_eviction import extend_lane_demand, lane_deficit

PAGE = 4


def _allocator(free: List[int]) -> SimpleNamespace:
    return SimpleNamespace(shard_size=len(free), page_size=PAGE, class_free_page_counts=lambda: list(free))


def _fits(free: List[int], prefix: List[int], seq: List[int]) -> bool:
    from sglang_cp_hicache.v0_5_23.eviction.lane_eviction import fits_any_rotation

    return fits_any_rotation(_allocator(free), prefix, seq)


def _evictor(free: List[int]):
    from sglang_cp_hicache.v0_5_23.eviction.lane_eviction import DeviceLaneEvictor

    starts = SimpleNamespace(per_base=[0] * len(free))
    return DeviceLaneEvictor(SimpleNamespace(cache=None, allocator=_allocator(free), chain_starts=starts))


def _cases():
    for lanes in (2, 3):
        for free in itertools.product(range(3), repeat=lanes):
            for pages in ((1,), (2,), (3,), (1, 2), (4,)):
                yield list(free), pages


@pytest.mark.parametrize("free, pages", list(_cases()))
def test_the_bound_never_admits_a_batch_some_rotation_leaves_short(free, pages) -> None:
    lanes = len(free)
    prefix = [PAGE * 2] * len(pages)  # page-aligned cached prefixes
    seq = [p + n * PAGE - 1 for p, n in zip(prefix, pages)]  # the last page partly filled
    fits = _fits(free, prefix, seq)
    short_somewhere = any(
        max(lane_deficit(extend_lane_demand(free, list(bases), prefix, seq, lanes, PAGE)[0], free)) > 0
        for bases in itertools.product(range(lanes), repeat=len(pages))
    )
    assert not (fits and short_somewhere)
    if fits:
        assert _evictor(free).make_extend_room([1] * len(pages), prefix, seq) == [1] * len(pages)


def test_a_tight_lane_takes_the_full_path() -> None:
    """Two pages at cp 2 need one page of each lane: lane 0 has none, so the bound says no
    (the full path then finds lane 0 short for every base)."""
    assert not _fits([0, 5], [0], [2 * PAGE])
    assert _fits([1, 5], [0], [2 * PAGE])
