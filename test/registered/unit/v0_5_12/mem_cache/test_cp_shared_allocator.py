"""CPSharedPagedTokenToKVPoolAllocator: owner lanes, balanced placement, upstream parity."""

from dataclasses import dataclass, field
from typing import List, Optional

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.mem_cache import allocator as upstream_allocator
from sglang.srt.mem_cache import common as sglang_common
from sglang.srt.mem_cache.allocator import (
    PagedTokenToKVPoolAllocator,
    alloc_extend_naive,
)

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (
    CPSharedPagedTokenToKVPoolAllocator,
    balanced_lane_counts,
    balanced_page_owners,
    extend_page_owners,
    extend_token_locs_host,
)
from sglang_cp_hicache.testing.v0_5_12.allocators import (
    NaiveExtendLaunch,
    build_cp_allocator,
)

CP_SIZES = (1, 2, 3, 4, 8)
PAGE_SIZES = (1, 16, 64)


make_allocator = build_cp_allocator


def lane_lists(allocator: CPSharedPagedTokenToKVPoolAllocator) -> List[List[int]]:
    return [t.tolist() for t in allocator.lanes.free_pages + allocator.lanes.release_pages]


def extend_args(prefix_lens: List[int], seq_lens: List[int], last_locs: List[int]):
    prefix = torch.tensor(prefix_lens, dtype=torch.int64)
    seq = torch.tensor(seq_lens, dtype=torch.int64)
    last_loc = torch.tensor(last_locs, dtype=torch.int64)
    return prefix, prefix.clone(), seq, seq.clone(), last_loc, int((seq - prefix).sum())


def pages_in_order(token_locs: torch.Tensor, page_size: int) -> torch.Tensor:
    """Distinct pages of ``token_locs`` in first-appearance order."""
    pages = (token_locs // page_size).numpy()
    _, first = np.unique(pages, return_index=True)
    return torch.from_numpy(pages[np.sort(first)])


def same_page_labels(token_locs: torch.Tensor, page_size: int) -> np.ndarray:
    """Index of the first token sharing each token's page: the page grouping, label-free."""
    _, first, inverse = np.unique(
        (token_locs // page_size).numpy(), return_index=True, return_inverse=True
    )
    return first[inverse]


# ---------------------------------------------------------------- construction
@pytest.mark.parametrize("cp_size", CP_SIZES)
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_sizes_and_lanes_after_construction(cp_size, page_size):
    allocator = make_allocator(cp_size, page_size, pages_per_lane=5, cp_rank=cp_size - 1)

    assert allocator.physical_size == 5 * page_size
    assert allocator.size == 5 * page_size * cp_size
    assert allocator.available_size() == allocator.size
    assert allocator.lane_available_pages().tolist() == [5] * cp_size
    assert allocator.layout.cp_rank == cp_size - 1 and allocator.cp_rank == cp_size - 1
    for lane, pages in enumerate(allocator.lanes.free_pages):
        # Physical pages 1..5 of lane `lane`; physical page 0 (logical page `lane`) is padding.
        assert pages.tolist() == [p * cp_size + lane for p in range(1, 6)]


# ------------------------------------------------------------------- placement
@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 20), min_size=1, max_size=8), st.integers(0, 60))
def test_balanced_counts_water_fill_the_free_lanes(lane_free, num_pages):
    counts = balanced_lane_counts(lane_free, num_pages)
    if num_pages > sum(lane_free):
        assert counts is None and balanced_page_owners(lane_free, num_pages) is None
        return
    assert sum(counts) == num_pages
    assert all(0 <= c <= free for c, free in zip(counts, lane_free))
    left = [free - c for free, c in zip(lane_free, counts)]
    # No page could move to a lane with more left without making the spread worse.
    for taker, c in enumerate(counts):
        if c:
            assert all(left[taker] + 1 >= left[other] for other in range(len(left)))
    # The definition, by a scan of every level: the lowest level whose excess fits, the
    # pages short of it on the lowest lanes still at that level.
    level = next(lv for lv in range(max(lane_free) + 1)
                 if sum(max(f - lv, 0) for f in lane_free) <= num_pages)  # fmt: skip
    expected = [max(f - level, 0) for f in lane_free]
    at_level = [lane for lane, f in enumerate(lane_free) if f >= level]
    for lane in at_level[: num_pages - sum(expected)]:
        expected[lane] += 1
    assert counts == expected
    owners = balanced_page_owners(lane_free, num_pages)
    assert np.bincount(owners, minlength=len(lane_free)).tolist() == counts
    # Dealt round by round: every prefix of the pages is as even as the counts allow.
    for end in range(1, num_pages + 1):
        prefix = np.bincount(owners[:end], minlength=len(lane_free))
        used = [lane for lane, c in enumerate(counts) if c > prefix[lane]]
        assert all(prefix[lane] >= prefix.max() - 1 for lane in used)


def test_sixteen_one_page_requests_at_cp8_spread_over_every_lane():
    allocator = make_allocator(8, 64, pages_per_lane=8)
    zeros = [0] * 16
    locs = allocator.alloc_extend(*extend_args(zeros, [64] * 16, [-1] * 16))
    owners = allocator.layout.page_owners_of_locs(locs)
    assert torch.bincount(owners, minlength=8).tolist() == [2] * 8
    # One page at a time (one request per batch) spreads too.
    single = make_allocator(8, 64, pages_per_lane=8)
    firsts = [int(single.alloc_extend(*extend_args([0], [64], [-1]))[0]) // 64 % 8 for _ in range(16)]
    assert sorted(np.bincount(firsts, minlength=8).tolist()) == [2] * 8


def test_extend_is_placed_on_the_free_lanes_when_others_are_held():
    allocator = make_allocator(2, 64, pages_per_lane=8)
    held = allocator.alloc_pages_with_owners([0] * 7)  # lane 0 held by running requests
    assert allocator.lane_free_pages() == [1, 8]
    # Exactly the nine free pages: the boundary where every free page is needed.
    locs = allocator.alloc_extend(*extend_args([0], [9 * 64], [-1]))
    assert locs is not None and allocator.available_size() == 0
    assert torch.bincount(allocator.layout.page_owners_of_locs(locs), minlength=2).tolist() == [1, 8]
    allocator.free(torch.cat([held, locs]))
    assert allocator.lane_free_pages() == [8, 8]


def test_upstream_extend_path_needs_no_eviction_while_any_lane_has_room(gloo_world1):
    """SGLang's own alloc_paged_token_slots_extend (scalar eviction) never evicts cache that
    sits on one lane while the other lanes' free pages cover the batch."""
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=64 * 8)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    allocator = stack.allocator
    held = allocator.alloc_pages_with_owners([0] * 8)  # lane 0: running requests
    cached = allocator.alloc_pages_with_owners([1] * 3)  # lane 1: cache, 5 pages free
    nsa_stack.insert_at_root(stack, list(range(10, 10 + 3 * 64)), cached)
    stack.cache.check_hicache_events()
    evictable = stack.cache.evictable_size()
    seq = torch.tensor([4 * 64])
    zero = torch.zeros(1, dtype=torch.int64)
    locs = sglang_common.alloc_paged_token_slots_extend(
        stack.cache, zero, zero, seq, seq, torch.tensor([-1]), 4 * 64
    )
    assert len(locs) == 4 * 64
    assert stack.cache.evictable_size() == evictable == 3 * 64
    assert allocator.layout.page_owners_of_locs(locs).tolist() == [1, 1, 1, 1]
    allocator.free(torch.cat([held, locs]))
    stack.close()


# ------------------------------------------------------ alloc_extend vs upstream
def upstream_alloc_extend(
    allocator: PagedTokenToKVPoolAllocator, prefix_lens, seq_lens, last_locs
) -> torch.Tensor:
    """Upstream ``alloc_extend`` itself, its Triton launch replaced by the naive reference."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(upstream_allocator, "alloc_extend_kernel", NaiveExtendLaunch())
        return allocator.alloc_extend(*extend_args(prefix_lens, seq_lens, last_locs))


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(CP_SIZES),
    st.sampled_from(PAGE_SIZES),
    st.lists(st.tuples(st.integers(0, 200), st.integers(1, 300)), min_size=1, max_size=3),
)
def test_alloc_extend_matches_upstream_layout_and_balances_new_pages(cp_size, page_size, requests):
    # Room for every page of the batch in any single lane.
    ours = make_allocator(cp_size, page_size, pages_per_lane=1500 // page_size + 8)
    upstream = PagedTokenToKVPoolAllocator(ours.size, page_size, torch.bfloat16, "cpu", None, False)
    prefix_lens = [p for p, _ in requests]
    seq_lens = [p + e for p, e in requests]

    # Materialise each request's prefix first so last_loc is real on both allocators.
    our_last, upstream_last = [], []
    for prefix_len in prefix_lens:
        if prefix_len == 0:
            our_last.append(-1)
            upstream_last.append(-1)
            continue
        our_prefix = ours.alloc_extend(*extend_args([0], [prefix_len], [-1]))
        our_last.append(int(our_prefix[-1]))
        upstream_last.append(int(upstream_alloc_extend(upstream, [0], [prefix_len], [-1])[-1]))

    lane_free = ours.lane_free_pages()
    our_locs = ours.alloc_extend(*extend_args(prefix_lens, seq_lens, our_last))
    upstream_locs = upstream_alloc_extend(upstream, prefix_lens, seq_lens, upstream_last)

    # Same offsets within pages and the same grouping of tokens into pages.
    assert torch.equal(our_locs % page_size, upstream_locs % page_size)
    np.testing.assert_array_equal(
        same_page_labels(our_locs, page_size), same_page_labels(upstream_locs, page_size)
    )
    # Exactly upstream's reference fed with the pages we picked.
    continued_pages = {last // page_size for last, p in zip(our_last, prefix_lens) if p % page_size}
    new_pages = torch.tensor(
        [p for p in pages_in_order(our_locs, page_size).tolist() if p not in continued_pages],
        dtype=torch.int64,
    )
    reference = torch.empty_like(our_locs)
    prefix, _, seq, _, last_loc, _ = extend_args(prefix_lens, seq_lens, our_last)
    alloc_extend_naive(prefix, seq, last_loc, new_pages, reference, page_size, "cpu")
    assert torch.equal(our_locs, reference)
    # The new pages are extend_page_owners' placement from the lanes' free counts before
    # the call (a request with prefix 0 starts a fresh chain).
    pages_per_request = [-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens)]
    fresh = [p == 0 for p in prefix_lens]
    expected_owners = extend_page_owners(lane_free, ours.sent_pages, pages_per_request, fresh)
    assert ours.layout.owner_for_logical_pages(new_pages).tolist() == expected_owners.tolist()


@settings(max_examples=40, deadline=None)
@given(
    st.sampled_from(CP_SIZES),
    st.sampled_from(PAGE_SIZES),
    st.lists(st.tuples(st.integers(0, 200), st.integers(0, 300)), min_size=1, max_size=4),
)
def test_recorded_pages_give_the_extend_locs_on_the_host(cp_size, page_size, requests):
    """The host mirror's source: the pages recorded during ``alloc_extend`` expand to
    exactly the locs it returned."""
    allocator = make_allocator(cp_size, page_size, pages_per_lane=2000 // page_size + 8)
    prefix_lens = [p for p, _ in requests]
    seq_lens = [p + e for p, e in requests]
    last_locs = [
        int(allocator.alloc_extend(*extend_args([0], [p], [-1]))[-1]) if p else -1
        for p in prefix_lens
    ]
    with allocator.recording_new_pages() as taken:
        locs = allocator.alloc_extend(*extend_args(prefix_lens, seq_lens, last_locs))
    new_pages = np.concatenate(taken)
    host = extend_token_locs_host(prefix_lens, seq_lens, np.array(last_locs), new_pages, page_size)
    np.testing.assert_array_equal(host, locs.numpy())
    with pytest.raises(ValueError, match="new pages"):
        extend_token_locs_host(
            prefix_lens, seq_lens, np.array(last_locs), np.append(new_pages, 0), page_size
        )


def test_cpu_path_never_launches_triton(monkeypatch):
    def no_triton(*args, **kwargs):
        raise AssertionError("Triton kernel launched")

    class _NoLaunch:
        def __getitem__(self, grid):
            return no_triton

    monkeypatch.setattr(upstream_allocator, "alloc_extend_kernel", _NoLaunch())
    monkeypatch.setattr(upstream_allocator, "alloc_decode_kernel", _NoLaunch())
    allocator = make_allocator(4, 16, pages_per_lane=8)

    locs = allocator.alloc_extend(*extend_args([0], [40], [-1]))
    decoded = allocator.alloc_decode(torch.tensor([41]), torch.tensor([41]), locs[-1:])

    assert decoded.tolist() == [int(locs[-1]) + 1]


def test_num_new_pages_must_match_lens():
    allocator = make_allocator(2, 16, pages_per_lane=8)
    with pytest.raises(ValueError):
        allocator.alloc_extend(*extend_args([0], [40], [-1]), num_new_pages=2)
    assert allocator.alloc_extend(*extend_args([0], [40], [-1]), num_new_pages=3) is not None


# ------------------------------------------------------------------ alloc_decode
@pytest.mark.parametrize("page_size", PAGE_SIZES)
def test_alloc_decode_continues_pages_and_balances_new_pages(page_size):
    cp_size = 4
    allocator = make_allocator(cp_size, page_size, pages_per_lane=6)
    # Four requests whose next token starts a new page, one that continues its page.
    seq_lens = torch.tensor(
        [1, page_size + 1, 2 * page_size + 1, 1, page_size + 2 if page_size > 1 else 1]
    )
    last_loc = torch.tensor([-1, 99, 199, -1, 300])

    locs = allocator.alloc_decode(seq_lens, seq_lens.clone(), last_loc)

    starts_page = (seq_lens - 1) % page_size == 0
    assert torch.equal(locs[~starts_page], last_loc[~starts_page] + 1)
    new_pages = locs[starts_page] // page_size
    assert torch.equal(locs[starts_page] % page_size, torch.zeros_like(new_pages))
    lane_counts = torch.bincount(lane_of(new_pages, cp_size), minlength=cp_size)
    assert int(lane_counts.max() - lane_counts.min()) <= 1


def test_alloc_decode_uses_the_fullest_lane():
    allocator = make_allocator(2, 16, pages_per_lane=4)
    assert allocator.alloc_pages_with_owners([0, 0, 0]) is not None

    locs = allocator.alloc_decode(torch.tensor([17]), torch.tensor([17]), torch.tensor([15]))

    assert int(locs[0]) // 16 % 2 == 1


# ------------------------------------------------------------------- plain alloc
@pytest.mark.parametrize("cp_size", CP_SIZES)
def test_alloc_balances_lanes_and_uses_all_capacity(cp_size):
    allocator = make_allocator(cp_size, 16, pages_per_lane=3)
    first = allocator.alloc(16 * (cp_size + 1))
    lanes = allocator.lane_available_pages()
    assert int(lanes.max() - lanes.min()) <= 1

    rest = allocator.alloc(allocator.available_size())

    assert first is not None and rest is not None
    assert allocator.available_size() == 0
    pages = torch.cat([first, rest]) // 16
    assert len(torch.unique(pages)) == 3 * cp_size
    assert allocator.alloc(16) is None


@pytest.mark.parametrize("need_sort", [False, True])
@pytest.mark.parametrize("pages_per_lane", [24, 8])  # 8: free lists run short mid-load
def test_taking_part_by_part_gives_the_pages_of_one_joined_take(need_sort, pages_per_lane):
    """A multi-node load checks and prepares the lanes once for all its nodes, then takes
    each node's pages in turn: the same pages, in the same order, as one allocation of the
    joined owners, also when a lane's free list is short of the total and (``need_sort``)
    its released pages must be merged first."""
    rng = np.random.default_rng(0)
    joined, by_part = (
        make_allocator(4, 16, pages_per_lane=pages_per_lane, need_sort=need_sort) for _ in range(2)
    )
    for allocator in (joined, by_part):  # churned free lists, identically
        taken = allocator.alloc(16 * 4 * (pages_per_lane - 3))
        allocator.free(taken[16 * 3 : 16 * 4 * (pages_per_lane - 5)])
    merged = 0
    for _ in range(12):
        parts = [rng.integers(0, 4, size=int(rng.integers(1, 4))) for _ in range(3)]
        owners = np.concatenate(parts)
        lane_pages = by_part.lane_demand(owners)
        if not by_part.lane_fits(lane_pages):
            break
        merged += any(
            need > len(free) for need, free in zip(lane_pages, by_part.lanes.free_pages)
        )
        expected = joined.alloc_logical_pages(owners)
        by_part.prepare_takes(lane_pages)
        pages = [by_part.take_logical_pages(part, by_part.lane_demand(part)) for part in parts]

        assert np.concatenate(pages).tolist() == expected.tolist()
        assert lane_of(np.concatenate(pages), 4).tolist() == owners.tolist()
        assert lane_lists(by_part) == lane_lists(joined)
    assert merged or not need_sort or pages_per_lane > 8  # the short case was reached


# ---------------------------------------------------------- exhaustion and recovery
@pytest.mark.parametrize("need_sort", [False, True])
def test_new_pages_fail_only_when_all_lanes_together_are_short(need_sort):
    cp_size, page_size = 4, 16
    allocator = make_allocator(cp_size, page_size, pages_per_lane=2, need_sort=need_sort)
    drained = allocator.alloc_pages_with_owners([0, 0])  # lane 0 is now empty
    assert allocator.alloc_extend(*extend_args([0], [4 * page_size], [-1])) is not None
    before_lists, before_size = lane_lists(allocator), allocator.available_size()
    request = extend_args([0], [3 * page_size], [-1])  # two pages are left in all

    assert allocator.alloc_extend(*request) is None

    assert lane_lists(allocator) == before_lists
    assert allocator.available_size() == before_size
    allocator.free(drained[:page_size])
    assert allocator.alloc_extend(*request) is not None


def test_lane_deficit_matches_failed_call_without_allocating():
    allocator = make_allocator(3, 16, pages_per_lane=2)
    owners = [2, 2, 2, 0, 1, 1, 1, 1]
    before = lane_lists(allocator)

    deficit = allocator.lane_deficit(allocator.lane_demand(np.array(owners)))

    assert deficit == [0, 2, 1]
    assert lane_lists(allocator) == before
    assert allocator.alloc_pages_with_owners(owners) is None
    assert lane_lists(allocator) == before


# ---------------------------------------------------------------- bookkeeping
def test_free_groups_need_sort_and_backup_restore():
    allocator = make_allocator(2, 16, pages_per_lane=4, need_sort=True)
    a = allocator.alloc_pages_with_owners([0, 1])
    b = allocator.alloc_pages_with_owners([1, 0])
    state = allocator.backup_state()
    size = allocator.available_size()

    allocator.free_group_begin()
    allocator.free(a)
    allocator.free(b)
    assert allocator.available_size() == size  # buffered until the group ends
    allocator.free_group_end()
    assert allocator.available_size() == size + 4 * 16
    assert sum(len(r) for r in allocator.lanes.release_pages) == 4  # need_sort parks pages

    allocator.restore_state(state)
    assert allocator.available_size() == size
    allocator.merge_and_sort_free()
    allocator.clear()
    assert allocator.available_size() == allocator.size
    assert allocator.lane_available_pages().tolist() == [4, 4]


def test_free_returns_each_page_to_its_owner_lane():
    allocator = make_allocator(4, 16, pages_per_lane=3)
    locs = allocator.alloc_pages_with_owners([3, 1, 3, 2])
    allocator.free(locs[16 + 5 :])  # every page but the first, page 1 only partially

    assert allocator.lane_available_pages().tolist() == [3, 3, 3, 2]
    for lane, pages in enumerate(allocator.lanes.free_pages):
        assert bool((lane_of(pages, 4) == lane).all())


# ------------------------------------------------------ random call sequences
@dataclass
class Held:
    token_locs: torch.Tensor
    seq_len: Optional[int] = None  # set for requests, None for plain blocks


@dataclass
class Driver:
    """Drives allocators of different ranks with one call sequence, checking invariants."""

    allocators: List[CPSharedPagedTokenToKVPoolAllocator]
    held: List[Held] = field(default_factory=list)

    @property
    def main(self) -> CPSharedPagedTokenToKVPoolAllocator:
        return self.allocators[0]

    def call(self, method: str, *args, expected_short: Optional[bool] = None):
        before = [(lane_lists(a), a.available_size()) for a in self.allocators]
        results = [getattr(a, method)(*args) for a in self.allocators]
        if expected_short is not None:
            assert (results[0] is None) == expected_short
        for allocator, result, (lists, size) in zip(self.allocators, results, before):
            assert (result is None) == (results[0] is None)
            if result is None:
                assert lane_lists(allocator) == lists and allocator.available_size() == size
            else:
                assert torch.equal(result, results[0])  # rank-invariant locs
        return results[0]

    def requests(self) -> List[int]:
        return [i for i, h in enumerate(self.held) if h.seq_len is not None]

    def check_invariants(self) -> None:
        allocator = self.main
        ps, cp = allocator.page_size, allocator.cp_size
        held_pages = [torch.unique(h.token_locs // ps) for h in self.held]
        all_pages = torch.cat(held_pages) if held_pages else torch.empty(0, dtype=torch.int64)
        assert len(torch.unique(all_pages)) == len(all_pages), "page handed out twice"
        assert bool((all_pages >= cp).all()), "padding page handed out"
        assert bool((all_pages // cp <= allocator.lanes.num_physical_pages).all())
        held_per_lane = torch.bincount(lane_of(all_pages, cp), minlength=cp)
        for a in self.allocators:
            assert torch.equal(
                a.lane_available_pages() + held_per_lane,
                torch.full((cp,), allocator.lanes.num_physical_pages),
            )
            assert a.available_size() + len(all_pages) * ps == a.size


@settings(max_examples=80, deadline=None)
@given(
    st.sampled_from(CP_SIZES),
    st.sampled_from(PAGE_SIZES),
    st.booleans(),
    st.integers(1, 6),
    st.data(),
)
def test_random_call_sequences_conserve_pages_and_agree_across_ranks(
    cp_size, page_size, need_sort, pages_per_lane, data
):
    ranks = sorted({0, cp_size - 1})
    driver = Driver(
        [make_allocator(cp_size, page_size, pages_per_lane, r, need_sort) for r in ranks]
    )
    for _ in range(data.draw(st.integers(1, 25), label="num_ops")):
        op = data.draw(st.sampled_from(["extend", "decode", "alloc", "owners", "free"]), label="op")
        if op == "extend":
            run_extend(driver, data, page_size)
        elif op == "decode":
            run_decode(driver, data)
        elif op == "alloc":
            num_pages = data.draw(st.integers(0, cp_size + 2), label="alloc_pages")
            locs = driver.call("alloc", num_pages * page_size)
            if locs is not None:
                assert len(locs) == num_pages * page_size
                driver.held.append(Held(locs))
        elif op == "owners":
            owners = data.draw(st.lists(st.integers(0, cp_size - 1), max_size=6), label="owners")
            demand = driver.main.lane_demand(np.array(owners, dtype=np.int64))
            short = any(driver.main.lane_deficit(demand))
            locs = driver.call("alloc_pages_with_owners", owners, expected_short=short)
            if locs is not None:
                assert driver.main.layout.page_owners_of_locs(locs).tolist() == owners
                driver.held.append(Held(locs))
        elif op == "free" and driver.held:
            run_free(driver, data)
        driver.check_invariants()

    for held in driver.held:
        for allocator in driver.allocators:
            allocator.free(held.token_locs)
    driver.held.clear()
    driver.check_invariants()


def run_extend(driver: Driver, data, page_size: int) -> None:
    continued = (
        data.draw(
            st.lists(st.sampled_from(driver.requests()), unique=True, max_size=2), label="continued"
        )
        if driver.requests()
        else []
    )
    num_new = data.draw(st.integers(0 if continued else 1, 2), label="num_new_requests")
    prefix_lens = [driver.held[i].seq_len for i in continued] + [0] * num_new
    last_locs = [int(driver.held[i].token_locs[-1]) for i in continued] + [-1] * num_new
    extend_lens = [
        data.draw(st.integers(1, 3 * page_size), label="extend_len") for _ in prefix_lens
    ]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens)]
    new_pages = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(prefix_lens, seq_lens))
    locs = driver.call(
        "alloc_extend",
        *extend_args(prefix_lens, seq_lens, last_locs),
        expected_short=new_pages > driver.main.available_size() // page_size,
    )
    if locs is None:
        return
    pieces = torch.split(locs, extend_lens)
    for index, piece, seq_len in zip(continued, pieces, seq_lens):
        driver.held[index] = Held(torch.cat([driver.held[index].token_locs, piece]), seq_len)
    for piece, seq_len in zip(pieces[len(continued) :], seq_lens[len(continued) :]):
        driver.held.append(Held(piece, seq_len))


def run_decode(driver: Driver, data) -> None:
    if not driver.requests():
        return
    chosen = data.draw(
        st.lists(st.sampled_from(driver.requests()), unique=True, min_size=1), label="decoded"
    )
    seq_lens = torch.tensor([driver.held[i].seq_len + 1 for i in chosen])
    last_loc = torch.tensor([int(driver.held[i].token_locs[-1]) for i in chosen])
    locs = driver.call("alloc_decode", seq_lens, seq_lens.clone(), last_loc)
    if locs is None:
        return
    for index, loc, seq_len in zip(chosen, locs, seq_lens.tolist()):
        driver.held[index] = Held(torch.cat([driver.held[index].token_locs, loc.view(1)]), seq_len)


def run_free(driver: Driver, data) -> None:
    grouped = data.draw(st.booleans(), label="free_group")
    victims = data.draw(
        st.lists(st.integers(0, len(driver.held) - 1), unique=True, min_size=1, max_size=2),
        label="victims",
    )
    for allocator in driver.allocators:
        if grouped:
            allocator.free_group_begin()
        for index in victims:
            allocator.free(driver.held[index].token_locs)
        if grouped:
            allocator.free_group_end()
    driver.held = [h for i, h in enumerate(driver.held) if i not in victims]
