"""New-chain placement of one extend batch (core.lane_eviction, no SGLang): requests whose
keys share a first page get one rotation base, so their inserts share one rotation run."""

from __future__ import annotations

from sglang_cp_hicache.core.lane_eviction import extend_lane_demand, first_page_leaders

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
