"""Host room for an L3 prefetch under CP shared KV (real 0.5.23 sharded stack, gloo cp 2).

A storage hit's host slots are drawn cyclically from the prefetch's start owner
(``alloc_prefetch_host_buffers_around``). When the host is full, upstream's
``HybridCacheController.allocate_storage_hit`` evicts ``hit_tokens`` host tokens by LRU
and retries, then falls back to the min-lane floor: on the sharded host pool the LRU
victim can free a page on another owner lane, the retry fails, the floor is 0 and the
whole hit is dropped (the simulator's L3 hit loss at cp 4, issue 24). Under the plugin the
eviction is the lane-aware one: the host leaf on the start owner's lane is evicted, the
LRU leaf on the other lane is kept, and the hit gets its slots.
"""

from __future__ import annotations

from typing import Dict, List

import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
SEED = 20261202
OLDER = list(range(1, PAGE + 1))
NEWER = list(range(10_001, 10_001 + PAGE))


def room_run(ctx: RankContext, folder: str) -> Dict[str, object]:
    from array import array

    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle, EvictParams
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_sharded_stack
    from sglang_cp_hicache.v0_5_23.mem_cache.host_lane_eviction import HostLaneEvictor
    from sglang_cp_hicache.v0_5_23.mem_cache.hybrid_cache.hybrid_cache_controller import (
        START_OWNER_ATTR,
    )

    storage.apply_plugin_hooks()
    with build_sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        cache, controller = stack.cache, stack.controller
        for tokens in (OLDER, NEWER):  # one host page each; OLDER is the LRU leaf
            storage.store_request(stack, tokens, storage.logical_kv(stack, tokens, SEED))
        cache.evict(EvictParams(num_tokens=stack.allocator.size))  # host-only leaves
        evictor = HostLaneEvictor(cache)
        priority = evictor._component().session_ref_eviction_strategy
        leaves = list(evictor.candidates(priority))
        lanes = [evictor.lane_pages(node).index(1) for node in leaves]
        # Fill every free host page, lane by lane, with held slots outside the tree.
        held: List[torch.Tensor] = []
        for lane, free in enumerate(evictor.free_pages()):
            held += [controller.mem_pool_host.alloc(PAGE, start_owner=lane) for _ in range(free)]
        operation = PrefetchOperation(CacheRequestHandle("l3-hit", 0), array("q", NEWER), None)
        setattr(operation, START_OWNER_ATTR, lanes[1])  # the lane of the non-LRU leaf
        slots, alloc_len = controller.allocate_storage_hit(
            operation, PAGE, allow_partial=True, min_tokens=PAGE, evict_host=cache.evict_host
        )
        report = {
            "leaf_lanes": lanes,
            "alloc_len": alloc_len,
            "slot_lanes": None if slots is None else [int(p) % stack.shard_size for p in slots[::PAGE] // PAGE],
            "older_on_host": stack.match(OLDER).host_hit_length,
            "tree": stack.tree_snapshot(),
        }
        if slots is not None:
            controller.mem_pool_host.free(slots)
        for chunk in held:
            controller.mem_pool_host.free(chunk)
        storage.detach_storage(stack)
    return report


def test_a_full_host_makes_lane_room_for_a_storage_hit(tmp_path):
    reports = run_ranks(2, room_run, str(tmp_path))
    assert reports[0]["tree"] == reports[1]["tree"], "ranks disagree on the tree"
    for report in reports:
        older_lane, newer_lane = report["leaf_lanes"]
        assert older_lane != newer_lane, report["leaf_lanes"]  # the scenario needs two lanes
        assert report["alloc_len"] == PAGE, report
        assert report["slot_lanes"] == [newer_lane], report
        assert report["older_on_host"] == PAGE, "the LRU leaf on the other lane was evicted"
