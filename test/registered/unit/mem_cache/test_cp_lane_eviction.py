"""Owner-lane exhaustion on the scheduler's extend path is recovered by lane-targeted eviction."""

import pytest
import torch
from sglang.srt.mem_cache import common as sglang_common
from sglang.srt.mem_cache.base_prefix_cache import InsertParams

from sglang_cp_hicache.mem_cache.common import alloc_paged_token_slots_extend_around
from sglang_cp_hicache.testing import nsa_stack

PS = 64
UPSTREAM_ALLOC = getattr(
    sglang_common.alloc_paged_token_slots_extend,
    "__wrapped__",
    sglang_common.alloc_paged_token_slots_extend,
)


def _lane0_full_of_cache(gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 8, split_mode="round-robin-split")
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    allocator = stack.allocator
    lane0 = int(allocator.lane_available_pages()[0])
    cached = allocator.alloc_pages_with_owners(torch.zeros(lane0, dtype=torch.int64))
    tokens = list(range(10, 10 + len(cached)))
    stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=cached))
    stack.cache.check_hicache_events()
    assert allocator.lane_available_pages().tolist() == [0, lane0]
    return stack


def _extend(alloc_fn, stack, seq_len=4 * PS):
    zero = torch.zeros(1, dtype=torch.int64)
    seq = torch.tensor([seq_len])
    return alloc_fn(stack.cache, zero, zero, seq, seq, torch.tensor([-1]), seq_len)


def test_upstream_scalar_eviction_cannot_recover_a_lane(gloo_world1):
    stack = _lane0_full_of_cache(gloo_world1)
    # Total free (lane 1) covers the request, so upstream evicts nothing and fails.
    with pytest.raises(RuntimeError, match="Prefill out of memory"):
        _extend(UPSTREAM_ALLOC, stack)
    stack.close()


def test_lane_targeted_eviction_recovers_and_keeps_owner_pattern(gloo_world1):
    stack = _lane0_full_of_cache(gloo_world1)
    locs = _extend(lambda *a: alloc_paged_token_slots_extend_around(UPSTREAM_ALLOC, *a), stack)
    assert len(locs) == 4 * PS
    assert stack.layout.page_owners_of_locs(locs).tolist() == [0, 1, 0, 1]
    stack.close()


def test_lane_held_by_running_requests_places_pages_on_free_lanes(gloo_world1, caplog):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 8, split_mode="round-robin-split")
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    allocator = stack.allocator
    # Lane 0 is held by running requests (not in the tree, so nothing can be evicted).
    held = allocator.alloc_pages_with_owners(torch.zeros(int(allocator.lane_available_pages()[0]) - 1, dtype=torch.int64))
    assert allocator.lane_available_pages().tolist() == [1, 8]
    with pytest.raises(RuntimeError, match="Prefill out of memory"):
        _extend(UPSTREAM_ALLOC, stack)
    with caplog.at_level("WARNING"):
        locs = _extend(lambda *a: alloc_paged_token_slots_extend_around(UPSTREAM_ALLOC, *a), stack)
    assert len(locs) == 4 * PS
    # Lane-balanced placement keeps the free counts as even as possible: [1, 8] -> [1, 4].
    assert stack.layout.page_owners_of_locs(locs).tolist() == [1, 1, 1, 1]
    assert "freest lanes" in caplog.text
    allocator.free(torch.cat([held, locs]))
    stack.close()
