"""A fresh chain's first pages on the lanes that sent the fewest pages (issue 25, PD sent balance).

The rule (:func:`extend_page_owners`), the allocator's use of it, and the real 0.5.12 stack:
SGLang's ``alloc_for_extend`` and ``release_kv_cache`` over ``CpHiRadixCache``, where the
finished request's prompt pages are counted as sent, identically on two ranks.
"""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_cp_hicache.testing.v0_5_12 import nsa_stack, scheduler_batch
from sglang_cp_hicache.testing.v0_5_12.allocators import build_cp_allocator
from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (
    balanced_lane_counts,
    balanced_page_owners,
    extend_page_owners,
)

PS = 64


# ------------------------------------------------------------------------ the rule
def test_heads_are_the_least_sent_lanes_then_the_freest_then_the_lowest():
    # The water-fill alone: [1, 1, 2, 0] pages; lane 3 sent least, so it takes a page of
    # lane 2's (the one lane the water-fill gives two).
    owners = extend_page_owners([8, 8, 9, 8], [5, 1, 1, 0], [4], [True])
    assert owners.tolist() == [3, 2, 1, 0]
    assert balanced_lane_counts([8, 8, 9, 8], 4) == [1, 1, 2, 0]
    # Nothing sent, lanes alike: the plain placement.
    assert extend_page_owners([8] * 4, [0] * 4, [4], [True]).tolist() == [0, 1, 2, 3]


def test_fresh_chain_starts_on_the_least_sent_lanes_keeping_the_water_fill():
    free, sent = [10, 10, 10, 10], [7, 7, 1, 1]
    owners = extend_page_owners(free, sent, [6], [True])
    # Every lane had a page of it anyway; the two pages past one a lane go to the cold
    # lanes too (the plain water-fill gives them to lanes 0, 1).
    assert owners.tolist() == [2, 3, 0, 1, 2, 3]
    assert np.bincount(owners, minlength=4).tolist() == balanced_lane_counts(free, 6, sent)
    assert balanced_lane_counts(free, 6) == [2, 2, 1, 1]
    # Fewer pages than lanes: the lane set itself is the least-sent one (lanes 0, 1 each
    # give up the page the water-fill planned there).
    assert balanced_page_owners(free, 2).tolist() == [0, 1]
    assert extend_page_owners(free, sent, [2], [True]).tolist() == [2, 3]


def test_a_lane_gives_or_takes_at_most_one_page_per_fresh_chain():
    # The water-fill puts all three pages on lane 3: it can give one page up, so one cold
    # lane gets a head; the other cold lanes keep their last free page.
    free, sent = [1, 1, 1, 10], [0, 0, 0, 50]
    assert balanced_lane_counts(free, 3) == [0, 0, 0, 3]
    assert extend_page_owners(free, sent, [3], [True]).tolist() == [0, 3, 3]


def test_pages_short_of_an_even_level_go_to_the_tied_lanes_that_sent_least():
    # Level 7 leaves one page to place among the lanes at it (0, 2, 3): lane 3 sent least.
    assert balanced_lane_counts([8, 5, 8, 8], 4) == [2, 0, 1, 1]
    assert balanced_lane_counts([8, 5, 8, 8], 4, [3, 0, 2, 1]) == [1, 0, 1, 2]
    # No page short of the level: nothing to choose.
    assert balanced_lane_counts([8, 5, 8, 8], 3, [3, 0, 2, 1]) == [1, 0, 1, 1]


def test_requests_with_a_cached_prefix_keep_the_balanced_placement():
    free, sent = [3, 9, 5, 9], [0, 50, 0, 50]
    owners = extend_page_owners(free, sent, [4, 3], [False, False])
    assert owners.tolist() == balanced_page_owners(free, 7).tolist()


def test_two_fresh_chains_of_one_batch_start_apart():
    owners = extend_page_owners([8] * 4, [0] * 4, [2, 2], [True, True])
    assert owners.tolist() == [0, 1, 2, 3]


def test_short_lanes_refuse_the_whole_batch():
    assert extend_page_owners([1, 0], [0, 0], [1, 1], [True, False]) is None
    # A full lane is never a head: the chain starts on the open one.
    assert extend_page_owners([0, 3], [0, 9], [2], [True]).tolist() == [1, 1]


@settings(max_examples=100, deadline=None)
@given(
    st.integers(1, 8).flatmap(
        lambda cp: st.tuples(
            st.lists(st.integers(0, 12), min_size=cp, max_size=cp),
            st.lists(st.integers(0, 30), min_size=cp, max_size=cp),
            st.lists(st.tuples(st.integers(0, 12), st.booleans()), min_size=1, max_size=4),
        )
    )
)
def test_placement_fits_and_moves_a_lane_by_at_most_a_page_per_fresh_chain(case):
    free, sent, requests = case
    pages = [n for n, _ in requests]
    fresh = [f for _, f in requests]
    owners = extend_page_owners(free, sent, pages, fresh)
    if sum(pages) > sum(free):
        assert owners is None
        return
    counts = np.bincount(owners, minlength=len(free))
    assert len(owners) == sum(pages) and all(counts <= free)
    water_fill = np.asarray(balanced_lane_counts(free, sum(pages), sent))
    assert np.abs(counts - water_fill).max(initial=0) <= sum(fresh)
    # The sent counts only choose among tied lanes: the lanes end as even as the plain
    # water-fill leaves them.
    plain = np.asarray(balanced_lane_counts(free, sum(pages)))
    assert sorted(np.asarray(free) - water_fill) == sorted(np.asarray(free) - plain)
    if not any(fresh):
        assert np.bincount(owners, minlength=len(free)).tolist() == water_fill.tolist()


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 8).flatmap(lambda cp: st.lists(st.integers(0, 30), min_size=cp, max_size=cp)), st.integers(1, 20))
def test_alike_lanes_give_a_fresh_chain_the_least_sent_lanes_in_order(sent, num_pages):
    cp = len(sent)
    owners = extend_page_owners([20] * cp, sent, [num_pages], [True])
    heads = min(num_pages, cp)
    assert owners.tolist()[:heads] == sorted(range(cp), key=lambda lane: (sent[lane], lane))[:heads]


# ------------------------------------------------------------------- the allocator
def test_alloc_extend_places_fresh_chains_by_the_counted_sent_pages():
    allocator = build_cp_allocator(4, PS, pages_per_lane=8)
    allocator.count_sent_pages(np.array([4, 8, 5, 9, 6], dtype=np.int64))  # lanes 0, 0, 1, 1, 2
    assert allocator.sent_pages == [2, 2, 1, 0]
    zero = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([3 * PS])
    locs = allocator.alloc_extend(zero, zero, seq, seq, torch.tensor([-1]), 3 * PS)
    assert allocator.layout.page_owners_of_locs(locs).tolist() == [3, 2, 0]
    allocator.clear()
    assert allocator.sent_pages == [0] * 4


# ----------------------------------------------- the real stack, two ranks alike
def _req(rid: str, ids: List[int]) -> Req:
    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=1),
    )


def _prefill(stack, rid: str, ids: List[int]) -> List[int]:
    """One request as a PD prefill server runs it: match, lock, ``alloc_for_extend``, then
    ``release_kv_cache`` once its KV went to decode; its pages' owners, in position order."""
    req = _req(rid, ids)
    req.init_next_round_input(stack.cache)
    stack.cache.inc_lock_ref(req.last_node)
    req.fill_ids = req.origin_input_ids
    scheduler_batch.alloc_for_extend(stack, [req], [len(ids)])
    req.kv_committed_len = req.kv_allocated_len = len(ids)
    row = stack.req_to_token_pool.req_to_token[req.req_pool_idx, : len(ids) : PS]
    release_kv_cache(req, stack.cache)
    stack.cache.check_hicache_events()
    return stack.layout.owner_for_logical_locs(row.to(torch.int64)).tolist()


@pytest.fixture
def two_ranks(gloo_world1, plugins_loaded):
    cfg = nsa_stack.StackConfig(cp_size=4, physical_tokens=PS * 16, req_pool_size=8, max_context_len=16 * PS)
    stacks = [nsa_stack.build_rank_stack(cfg, rank, None, gloo_world1) for rank in (0, 3)]
    with scheduler_batch.cpu_scheduler_server_args(PS):
        yield stacks
    for stack in stacks:
        stack.close()


def test_fresh_chain_starts_on_the_lanes_that_sent_least_on_every_rank(two_ranks):
    hot = [1000 + i for i in range(2 * PS)]  # a system prompt: every request of it sends it
    steps = [
        ("a", hot),  # fresh: lanes 0, 1 (nothing sent yet: the freest, then the lower)
        ("a2", hot + [5000 + i for i in range(2 * PS)]),  # hit; its new pages on lanes 2, 3
        ("b", [9000 + i for i in range(5 * PS)]),  # fresh again
    ]
    owners = [[_prefill(stack, rid, ids) for rid, ids in steps] for stack in two_ranks]
    assert owners[0] == owners[1]
    a, a2, b = owners[0]
    assert a == [0, 1] and a2 == [0, 1, 2, 3]
    # Sent before b: lanes 0, 1 twice (the hot pages), 2, 3 once; the lanes are equally
    # free. b's first pages go to the cold lanes first (the free counts alone put them on
    # 0, 1, 2, 3), and its fifth, one past an even level, to the least-sent lane of those
    # tied at it (the plain water-fill: lane 0).
    assert b == [2, 3, 0, 1, 2]
    sent = [stack.allocator.sent_pages for stack in two_ranks]
    assert sent[0] == sent[1] == [3, 3, 3, 2]


def test_a_retracted_request_sends_nothing(two_ranks):
    stack = two_ranks[0]
    req = _req("retracted", list(range(1, 1 + 3 * PS)))
    req.init_next_round_input(stack.cache)
    stack.cache.inc_lock_ref(req.last_node)
    req.fill_ids = req.origin_input_ids
    scheduler_batch.alloc_for_extend(stack, [req], [3 * PS])
    req.kv_committed_len = req.kv_allocated_len = 3 * PS
    release_kv_cache(req, stack.cache, is_insert=False)
    assert stack.allocator.sent_pages == [0] * 4
