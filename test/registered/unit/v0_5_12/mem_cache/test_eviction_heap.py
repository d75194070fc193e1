"""Incremental eviction heap: same victims as a heap rebuilt from the leaf set, every time.

* :class:`EvictableLeafSet` alone: its lazy heap pops members in fresh-sort order after
  random adds, removals and key growth, and stays bounded under lock/unlock churn.
* Twin run: our cache with a plain allocator and upstream ``HiRadixCache`` (same node-id
  tie-break, evict frees grouped as ours) replay one random scheduler-like workload under
  a frozen clock; after every step both trees are identical (structure, ids, residency,
  device and host slots, times, counts).
* CP mode: the same workload on rank 0 of cp 2; after every step each leaf heap lists its
  members in fresh-sort order, and a one-token eviction takes the fresh minimum.
"""

from __future__ import annotations

import random
import time
from contextlib import closing

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.v0_5_12.mem_cache.eviction_heap import EvictableLeafSet
from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import NodeIdTieBreak
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


# ------------------------------------------------------------------ leaf set alone
def _node(node_id: int) -> TreeNode:
    return TreeNode(id=node_id)


def test_lazy_heap_pops_in_fresh_sort_order_under_random_growth():
    rng = random.Random(0)
    priority = {}
    leaves = EvictableLeafSet(lambda n: priority[n.id], keys_only_grow=True)
    nodes = [_node(i) for i in range(200)]
    for _ in range(3000):
        node = rng.choice(nodes)
        action = rng.random()
        if action < 0.4:
            priority[node.id] = priority.get(node.id, 0) + rng.randint(0, 3)
            leaves.add(node)
        elif action < 0.7:
            leaves.discard(node)
        elif node.id in priority:
            priority[node.id] += rng.randint(0, 2)  # ties are common: node id decides
    expected = sorted(leaves, key=lambda n: (priority[n.id], n.id))
    assert leaves.ordered() == expected
    assert leaves.ordered() == expected  # inspecting consumed nothing


def test_in_order_and_out_of_order_entries_merge_into_one_victim_order():
    """LRU-like keys: most leaves enter stamped with the current time (in order), some
    with an older key (a parent that becomes a leaf), members are touched while queued
    and ties are common; victims interleave both kinds, evicting as they go."""
    rng = random.Random(1)
    priority = {}
    leaves = EvictableLeafSet(lambda n: priority[n.id], keys_only_grow=True)
    nodes = [_node(i) for i in range(300)]
    now = 0
    for round_ in range(40):
        for _ in range(60):
            now += rng.randint(0, 1)
            node = rng.choice(nodes)
            action = rng.random()
            if action < 0.5 and node not in leaves:
                priority[node.id] = now if rng.random() < 0.8 else rng.randint(0, now)
                leaves.add(node)
            elif action < 0.7 and node in leaves:
                priority[node.id] = now  # touched while queued: its entry goes stale
            elif action < 0.85:
                leaves.discard(node)
        expected = sorted(leaves, key=lambda n: (priority[n.id], n.id))
        assert leaves.ordered() == expected
        taken = []
        with closing(leaves.victims()) as victims:
            for node in victims:
                taken.append(node)
                leaves.remove(node)
                if len(taken) == round_ % 5:
                    break
        assert taken == expected[: len(taken)]


def test_rebuild_mode_handles_decreasing_keys():
    priority = {i: 100 - i for i in range(50)}
    leaves = EvictableLeafSet(lambda n: priority[n.id], keys_only_grow=False)
    nodes = [_node(i) for i in range(50)]
    for node in nodes:
        leaves.add(node)
    for node in nodes[::3]:
        priority[node.id] = -node.id  # MRU-like: a touch lowers the key
    assert leaves.ordered() == sorted(nodes, key=lambda n: (priority[n.id], n.id))


def test_skipped_members_stay_candidates_and_churn_stays_bounded():
    leaves = EvictableLeafSet(lambda n: 0.0, keys_only_grow=True)
    nodes = [_node(i) for i in range(10)]
    for node in nodes:
        leaves.add(node)
    locked = {nodes[0], nodes[3]}
    taken = []
    for node in leaves.victims(lambda n: n not in locked):
        taken.append(node)
        leaves.remove(node)
        if len(taken) == 3:
            break
    assert [n.id for n in taken] == [1, 2, 4]
    assert [n.id for n in leaves.ordered()] == [0, 3, 5, 6, 7, 8, 9]
    for _ in range(20000):  # lock/unlock of a leaf: remove, then add again
        leaves.remove(nodes[5])
        leaves.add(nodes[5])
    assert leaves.heap_size() <= 2 * len(leaves) + 1024


# ------------------------------------------------------------------ workload
class FrozenClock:
    """``time.monotonic`` that moves only between steps, so per-node and per-call clock
    reads agree and twins see identical times."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Workload:
    """Scheduler-like calls on one rank stack: requests match (and load back) a prefix,
    hold it locked while running, then insert their tokens as a finished request does."""

    def __init__(self, stack, seed: int, cp: bool) -> None:
        self.stack, self.cache, self.cp = stack, stack.cache, cp
        self.rng = random.Random(seed)
        self.sequences = [[]]
        self.running = []
        self.next_token = 1
        # This tree's TreeNode.counter: twins share the global one, ids must not.
        self.node_counter = self.cache.root_node.id + 1

    def step(self) -> str:
        saved, TreeNode.counter = TreeNode.counter, self.node_counter
        try:
            op = self._draw_op()
            getattr(self, op)()
            self.cache.check_hicache_events()
            return op
        finally:
            self.node_counter, TreeNode.counter = TreeNode.counter, saved

    def _draw_op(self) -> str:
        ops = ["start", "start", "finish", "finish", "evict"] + ([] if self.cp else ["evict_host"])
        op = self.rng.choice(ops)
        if op == "finish" and not self.running:
            return "start"
        return op

    def start(self) -> None:
        base = self.rng.choice(self.sequences)
        cut = self.rng.randint(0, len(base) // PS) * PS
        fresh = list(range(self.next_token, self.next_token + self.rng.randint(1, 3) * PS))
        self.next_token += len(fresh)
        tokens = base[:cut] + fresh
        cache = self.cache
        match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
        prefix, last = match.device_indices, match.last_device_node
        if match.host_hit_length > 0:
            loaded, last = cache.init_load_back(
                InitLoadBackParams(
                    best_match_node=match.best_match_node,
                    host_hit_length=match.host_hit_length,
                )
            )
            cache.ready_to_load_host_cache()
            prefix = torch.cat([prefix, loaded])
        cache.inc_lock_ref(last)
        self.running.append((tokens, prefix, last))

    def finish(self) -> None:
        tokens, prefix, last = self.running.pop(self.rng.randrange(len(self.running)))
        cache, allocator = self.cache, self.stack.allocator
        need = len(tokens) - len(prefix)
        if allocator.available_size() < need:
            cache.evict(EvictParams(num_tokens=need - allocator.available_size()))
        new = allocator.alloc(need)
        if new is not None:
            value = torch.cat([prefix, new])
            result = cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=value))
            allocator.free(value[len(prefix) : result.prefix_len])  # already cached
            self.sequences.append(tokens)
        cache.dec_lock_ref(last)

    def evict(self) -> None:
        self.cache.evict(EvictParams(num_tokens=self.rng.randint(1, 4) * PS))

    def evict_host(self) -> None:
        self.cache.evict_host(self.rng.randint(1, 4) * PS)


def _locs(value):
    return None if value is None else tuple(torch.as_tensor(value).tolist())  # root: []


def tree_state(cache) -> list:
    """Everything eviction and hit decisions depend on, node by node."""
    rows, stack = [], [cache.root_node]
    while stack:
        node = stack.pop()
        rows.append(
            (
                node.id,
                None if node.parent is None else node.parent.id,
                tuple(node.key.token_ids),
                _locs(node.value),
                _locs(node.host_value),
                node.lock_ref,
                node.hit_count,
                node.last_access_time,
                node.priority,
            )
        )
        stack.extend(node.children.values())
    return sorted(rows, key=lambda row: row[0]) + [
        cache.evictable_size(),
        cache.protected_size(),
        cache.token_to_kv_pool_allocator.available_size(),
        cache.token_to_kv_pool_host.available_size(),
        sorted(n.id for n in cache.evictable_leaves),
        sorted(n.id for n in cache.evictable_host_leaves),
    ]


def fresh_order(cache, leaves) -> list:
    return sorted(leaves, key=cache.eviction_strategy.get_priority)


def _free_in_one_group(cache) -> None:
    """Upstream's evict with its frees batched in one free group, as ours are: without
    it only the order of the device free list (so later slot numbers) would differ."""
    evict, allocator = cache.evict, cache.token_to_kv_pool_allocator

    def grouped(params):
        allocator.free_group_begin()
        try:
            return evict(params)
        finally:
            allocator.free_group_end()

    cache.evict = grouped


@pytest.fixture
def frozen_clock(monkeypatch):
    clock = FrozenClock()
    monkeypatch.setattr(time, "monotonic", clock)
    return clock


# ------------------------------------------------------------------ caches
def test_twin_of_upstream_makes_identical_decisions(gloo_world1, frozen_clock):
    cfg = nsa_stack.StackConfig(physical_tokens=PS * 24, hicache_ratio=1.5, layer_num=1)
    ours = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False, cache_cls=CpHiRadixCache)
    upstream = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False)
    assert type(upstream.cache) is not CpHiRadixCache
    upstream.cache.eviction_strategy = NodeIdTieBreak(upstream.cache.eviction_strategy)
    _free_in_one_group(upstream.cache)
    twins = [Workload(ours, seed=7, cp=False), Workload(upstream, seed=7, cp=False)]
    ops = set()
    for _ in range(400):
        frozen_clock.now += 1.0
        ops.update(twin.step() for twin in twins)
        assert tree_state(ours.cache) == tree_state(upstream.cache)
        for leaves in (ours.cache.evictable_leaves, ours.cache.evictable_host_leaves):
            assert leaves.ordered() == fresh_order(ours.cache, leaves)
    assert ops == {"start", "finish", "evict", "evict_host"}
    assert ours.cache.evictable_host_leaves  # host eviction had candidates to choose from
    ours.close()
    upstream.close()


def test_cp_mode_heaps_match_fresh_rebuild(gloo_world1, frozen_clock):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 12, hicache_ratio=1.25, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    cache = stack.cache
    workload = Workload(stack, seed=3, cp=True)
    # Batched host frees still show one release_host per victim (hooks count nodes).
    controller = cache.cache_controller
    released, detached = [], []
    real_release, real_detach = controller.release_host, cache._detach_host_leaf

    def counting_release(locs, node_id=-1):
        released.append(len(locs))
        return real_release(locs, node_id)

    def counting_detach(node):
        detached.append(len(node.host_value))
        return real_detach(node)

    controller.release_host, cache._detach_host_leaf = counting_release, counting_detach
    for _ in range(300):
        frozen_clock.now += 1.0
        workload.step()
        for leaves in (cache.evictable_leaves, cache.evictable_host_leaves):
            assert leaves.ordered() == fresh_order(cache, leaves)
        if cache.evictable_leaves:
            expected = fresh_order(cache, cache.evictable_leaves)[0]
            cache.evict(EvictParams(num_tokens=1))
            in_tree = expected.parent.children.get(expected.key.child_key(PS)) is expected
            assert expected.evicted or not in_tree
    assert detached  # lane-targeted host eviction ran on the persistent heap
    assert released == detached
    host = cache.token_to_kv_pool_host
    assert controller.host_table.lane_used_pages()[0] * PS == host.size - host.available_size()
    stack.close()
