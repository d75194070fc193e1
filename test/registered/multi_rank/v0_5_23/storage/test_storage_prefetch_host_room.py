"""Host room for an L3 prefetch under CP shared KV (real 0.5.23 sharded stack, gloo cp 2).

A storage hit's host slots are drawn cyclically from the prefetch's start owner
(``alloc_prefetch_host_buffers_around``). When the host is full, upstream's
``HybridCacheController.allocate_storage_hit`` evicts ``hit_tokens`` host tokens by LRU
and retries, then falls back to the min-lane floor: on the sharded host pool the LRU
victim can free a page on another owner lane, the retry fails, the floor is 0 and the
whole hit is dropped (the simulator's L3 hit loss at cp 4, issue 24). Under the plugin the
eviction is the lane-aware one: the host leaf on the start owner's lane is evicted, the
LRU leaf on the other lane is kept, and the hit gets its slots.

A prefetch whose match stops at the root has no chain phase to continue: its host slots,
and the device rows a load-back later draws from them, start a new rotation run. The
plugin places it by the rule a new extend chain follows (``root_chain_start``: spread from
the chains started before, ``ChainStarts``) instead of upstream's least-full class, which
would pile it on the lane an extend's chain already started on, and counts it as a started
chain once its slots are held.
"""

from __future__ import annotations

import contextlib
from array import array
from typing import Dict, Iterator, List, Optional, Sequence

import torch

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
SEED = 20261202
OLDER = list(range(1, PAGE + 1))
NEWER = list(range(10_001, 10_001 + PAGE))
ROOT_READ = list(range(1, 2 * PAGE + 1))


@contextlib.contextmanager
def file_storage_stack(ctx: RankContext, folder: str) -> Iterator[object]:
    """One rank's sharded stack with the plugin's hooks and the file backend attached."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        yield stack
        storage.detach_storage(stack)


def hold_free_host_pages(controller, free_per_lane: Sequence[int]) -> List[torch.Tensor]:
    """Take every free host page, lane by lane, as held slots outside the tree."""
    return [
        controller.mem_pool_host.alloc(PAGE, start_owner=lane)
        for lane, free in enumerate(free_per_lane)
        for _ in range(free)
    ]


def storage_hit(controller, cache, request: str, tokens: List[int], start_owner: Optional[int]):
    """``allocate_storage_hit`` for a prefetch of ``tokens`` whose start owner was recorded
    as ``start_owner`` (None: anchored at the root)."""
    from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle
    from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation

    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    start_owners = extension_of(cache).start_owners
    operation = PrefetchOperation(CacheRequestHandle(request, 0), array("q", tokens), None)
    start_owners[operation] = start_owner
    slots, alloc_len = controller.allocate_storage_hit(
        operation, len(tokens), allow_partial=True, min_tokens=PAGE, evict_host=cache.evict_host
    )
    return slots, alloc_len, start_owners[operation]


def slot_lanes(stack, slots: Optional[torch.Tensor]) -> Optional[List[int]]:
    return None if slots is None else lane_of(slots[::PAGE] // PAGE, stack.shard_size).tolist()


def room_run(ctx: RankContext, folder: str) -> Dict[str, object]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import HostLaneEvictor

    with file_storage_stack(ctx, folder) as stack:
        cache, controller = stack.cache, stack.controller
        for tokens in (OLDER, NEWER):  # one host page each; OLDER is the LRU leaf
            storage.store_request(stack, tokens, storage.request_kv(stack, tokens, SEED))
        cache.evict(EvictParams(num_tokens=stack.allocator.size))  # host-only leaves
        evictor = HostLaneEvictor(extension_of(cache))
        priority = evictor._component().session_ref_eviction_strategy
        leaves = list(evictor.candidates(priority))
        lanes = [evictor.lane_pages(node).index(1) for node in leaves]
        held = hold_free_host_pages(controller, evictor.free_pages())
        # The lane of the non-LRU leaf.
        slots, alloc_len, _ = storage_hit(controller, cache, "l3-hit", NEWER, lanes[1])
        report = {
            "leaf_lanes": lanes,
            "alloc_len": alloc_len,
            "slot_lanes": slot_lanes(stack, slots),
            "older_on_host": stack.match(OLDER).host_hit_length,
            "tree": stack.tree_snapshot(),
            "plans_by_path": {p: r.plans for p, r in extension_of(cache).host_stats.paths.items()},
        }
        if slots is not None:
            controller.mem_pool_host.free(slots)
        for chunk in held:
            controller.mem_pool_host.free(chunk)
    return report


def root_read_run(ctx: RankContext, folder: str) -> Dict[str, object]:
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    with file_storage_stack(ctx, folder) as stack:
        cache, controller = stack.cache, stack.controller
        started = extension_of(controller.mem_pool_device_allocator).chain_starts
        started.add([0])  # an extend started one chain on lane 0
        host_slots = controller.mem_pool_host.anchor_entry.host_pool._slots
        report: Dict[str, object] = {
            "same_allocator": controller.mem_pool_device_allocator is stack.allocator,
            "upstream_start": host_slots.least_full_class(),
        }
        slots, report["alloc_len"], report["recorded_start"] = storage_hit(
            controller, cache, "root", ROOT_READ, None
        )
        report["slot_lanes"] = slot_lanes(stack, slots)
        report["starts_after_read"] = list(started.per_base)
        controller.mem_pool_host.free(slots)
        # A read the host cannot hold at all: no slots, no chain.
        held = hold_free_host_pages(controller, host_slots.class_free_page_counts())
        slots, alloc_len, _ = storage_hit(controller, cache, "full", ROOT_READ, None)
        report["refused"] = (slots is None, alloc_len)
        report["starts_after_refusal"] = list(started.per_base)
        for chunk in held:
            controller.mem_pool_host.free(chunk)
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
        # counted as the storage hit's room (the extension's host_stats, by path)
        assert report["plans_by_path"] == {"backup": 0, "layer_backup": 0, "storage_hit": 1}, report


def test_a_root_anchored_read_starts_its_chain_spread_from_the_chains_started(tmp_path):
    reports = run_ranks(2, root_read_run, str(tmp_path))
    assert reports[0] == reports[1], "ranks disagree"
    report = reports[0]
    assert report["same_allocator"], report
    assert report["upstream_start"] == 0, report  # upstream would start it on lane 0 too
    assert report["alloc_len"] == len(ROOT_READ), report
    assert report["recorded_start"] == 1, report
    assert report["slot_lanes"] == [1, 0], report
    assert report["starts_after_read"] == [1, 1], report
    assert report["refused"] == (True, 0), report
    assert report["starts_after_refusal"] == [1, 1], report
