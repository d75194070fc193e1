"""New-chain placement of one extend batch (core.lane_eviction, no SGLang): requests whose
keys share a first page get one rotation base, so their inserts share one rotation run;
with the chains started so far, a new chain's base is spread from theirs among the lanes
its draws fit."""

from __future__ import annotations

from sglang_cp_hicache.core.lane_eviction import (
    base_overlaps,
    extend_lane_demand,
    first_page_leaders,
    new_chain_base,
)
from sglang_cp_hicache.core.rotation import run_lane_counts

PAGE = 64


def test_leaders_are_the_earliest_earlier_request_with_the_same_first_page() -> None:
    assert first_page_leaders(["a", "b", "a", None, "b", "a", None]) == [
        None, None, 0, None, 1, 0, None,
    ]  # fmt: skip
    assert first_page_leaders([]) == []


def test_a_new_chain_with_a_leader_takes_the_leaders_base() -> None:
    """Free [4, 4]: the first 3-page chain starts on lane 0 (draws [2, 1]); fit-first
    puts the second on lane 1, the freest; with the first as its leader it starts on 0."""
    args = ([4, 4], [None, None], [0, 0], [3 * PAGE, 2 * PAGE], 2, PAGE)
    assert extend_lane_demand(*args, fit_first=True) == ([3, 2], [0, 1])
    assert extend_lane_demand(*args, fit_first=True, leaders=[None, 0]) == ([3, 2], [0, 0])


def test_the_leaders_base_is_its_resolved_one_and_continuing_chains_keep_theirs() -> None:
    # The leader continues a cached chain at base 3: the follower's new chain takes 3.
    demand, bases = extend_lane_demand(
        [2, 2, 2, 2], [3, None], [PAGE, 0], [2 * PAGE, 2 * PAGE], 4, PAGE,
        fit_first=True, leaders=[None, 0],
    )  # fmt: skip
    assert bases == [3, 3] and demand == [2, 0, 0, 1]
    # A continuing chain keeps its own base even with a leader.
    _, bases = extend_lane_demand(
        [2, 2, 2, 2], [None, 2], [0, PAGE], [PAGE, 2 * PAGE], 4, PAGE,
        fit_first=True, leaders=[None, 0],
    )  # fmt: skip
    assert bases == [0, 2]


def test_the_overlap_is_least_opposite_the_started_chains() -> None:
    assert base_overlaps([0] * 8, 8) == [0] * 8
    one = base_overlaps([1, 0, 0, 0, 0, 0, 0, 0], 8)
    assert one.index(min(one)) == 4 and one[0] == max(one)
    assert one[1:4] == one[5:8][::-1]  # symmetric around the started chain
    two = base_overlaps([1, 0, 0, 0, 1, 0, 0, 0], 8)
    assert {lane for lane in range(8) if two[lane] == min(two)} == {2, 6}
    # Counts weigh: with two chains on lane 0 and one on lane 4, lane 4 overlaps less.
    weighted = base_overlaps([2, 0, 0, 0, 1, 0, 0, 0], 8)
    assert weighted[4] < weighted[0]


def test_new_chains_spread_from_the_chains_started_before_the_batch() -> None:
    """Cp 8, free pages on every lane equal (a full pool after eviction, or a fresh one):
    upstream's rule starts every new chain on lane 0 (ties to the lowest), so every
    request continuing them lays its extra pages on lanes 0, 1, 2...; with the chains
    started so far each new one goes opposite them."""
    free, pages = [16] * 8, 5
    bases = []
    starts = [0] * 8
    for _ in range(3):  # one new chain per batch, the pool refilled in between
        _, (base,) = extend_lane_demand(
            free, [None], [0], [pages * PAGE], 8, PAGE, fit_first=True, chain_starts=starts
        )
        bases.append(base)
        starts[base] += 1
        _, (upstream,) = extend_lane_demand(free, [None], [0], [pages * PAGE], 8, PAGE)
        assert upstream == 0
    assert bases == [0, 4, 2]
    # The batch's own new chains count as they resolve.
    _, resolved = extend_lane_demand(
        free, [None] * 3, [0] * 3, [pages * PAGE] * 3, 8, PAGE,
        fit_first=True, chain_starts=[0] * 8,
    )  # fmt: skip
    assert resolved == [0, 4, 2]


def test_a_lane_the_draws_do_not_fit_is_never_taken_for_spread() -> None:
    """A chain started on lane 2 makes lane 0 the least overlapping of cp 4, but a 3-page
    chain from lane 0 needs a page on lane 1, which is empty: it starts where it fits."""
    free, starts = [4, 0, 4, 4], [0, 0, 1, 0]
    overlap = base_overlaps(starts, 4)
    assert overlap.index(min(overlap)) == 0
    demand, (base,) = extend_lane_demand(
        free, [None], [0], [3 * PAGE], 4, PAGE, fit_first=True, chain_starts=starts
    )
    assert base == 2 and demand == run_lane_counts(2, 3, 4)
    assert all(need <= have for need, have in zip(demand, free))
    # When no lane fits, the chain goes where upstream puts it (the freest, lowest).
    _, (base,) = extend_lane_demand(
        [1, 1, 1, 1], [None], [0], [8 * PAGE], 4, PAGE, fit_first=True, chain_starts=starts
    )
    assert base == 0


def test_one_rule_places_a_new_chain_for_an_extend_and_for_a_root_anchored_read() -> None:
    """``new_chain_base`` is the rule ``extend_lane_demand`` applies to each new chain (an
    L3 prefetch from the root starts a chain too): on every free-lane state, chain count
    and length, the same base."""
    import itertools

    for free, starts, pages in itertools.product(
        ([4, 0, 4, 4], [3, 3, 3, 3], [1, 2, 3, 4], [0, 0, 0, 5]),
        ([0, 0, 0, 0], [0, 0, 1, 0], [2, 1, 0, 0]),
        (1, 3, 4, 6),
    ):
        _, (expected,) = extend_lane_demand(
            free, [None], [0], [pages * PAGE], 4, PAGE, fit_first=True, chain_starts=starts
        )
        assert new_chain_base(free, pages, 4, chain_starts=starts) == expected
        _, (upstream,) = extend_lane_demand(free, [None], [0], [pages * PAGE], 4, PAGE)
        assert new_chain_base(free, pages, 4, chain_starts=starts, fit_first=False) == upstream
    # Spread, then fit: one chain on lane 0 of cp 4 sends a 2-page chain to lane 2.
    assert new_chain_base([8] * 4, 2, 4, chain_starts=[1, 0, 0, 0]) == 2
