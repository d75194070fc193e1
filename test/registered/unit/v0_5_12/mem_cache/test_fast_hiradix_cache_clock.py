"""One clock read per tree walk (match, insert, host insert), upstream semantics otherwise.

* Counting clock: a walk over an existing deep path reads ``time.monotonic`` once (upstream:
  once per node) and stamps every node it touches with that one time.
* Frozen clock twin: a fixed scenario (splits of device and host-only nodes, revival on
  insert, chunked inserts, priorities, storage-style host inserts) leaves our tree and
  upstream's identical node by node.
* With equal timestamps (common once a call stamps many nodes alike) the non-CP path
  evicts in node-id order too.
"""

from __future__ import annotations

import time

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.v0_5_12.mem_cache.fast_hiradix_cache import NodeIdTieBreak
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
DEPTH = 6


def _build(gloo_world1, upstream: bool = False, shared_kv: bool = False):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 24, layer_num=1)
    cache_cls = None if upstream else CpHiRadixCache
    return nsa_stack.build_rank_stack(
        cfg, 0, None, gloo_world1, shared_kv=shared_kv, cache_cls=None if shared_kv else cache_cls
    )


def _insert(stack, tokens, **kwargs):
    cache, allocator = stack.cache, stack.allocator
    match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    value = torch.cat([match.device_indices, allocator.alloc(len(tokens) - len(match.device_indices))])
    result = cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=value, **kwargs))
    cache.check_hicache_events()
    return result


def _deep_path(stack) -> list:
    """DEPTH nested prefixes, one page per level: a path of DEPTH nodes."""
    tokens = list(range(1, 1 + DEPTH * PS))
    for depth in range(1, DEPTH + 1):
        _insert(stack, tokens[: depth * PS])
    return tokens


class CountingClock:
    def __init__(self, real) -> None:
        self.real, self.calls = real, 0

    def __call__(self) -> float:
        self.calls += 1
        return self.real()


@pytest.mark.parametrize("shared_kv", [False, True], ids=["cp_off", "cp_on"])
def test_walks_read_the_clock_once(gloo_world1, monkeypatch, shared_kv):
    stack = _build(gloo_world1, shared_kv=shared_kv)
    tokens = _deep_path(stack)
    clock = CountingClock(time.monotonic)
    monkeypatch.setattr(time, "monotonic", clock)
    cache = stack.cache

    match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    assert clock.calls == 1 and len(match.device_indices) == DEPTH * PS
    path = []
    node = match.last_device_node
    while node is not cache.root_node:
        path.append(node)
        node = node.parent
    assert len(path) == DEPTH
    assert {n.last_access_time for n in path + [cache.root_node]} == {path[0].last_access_time}

    clock.calls = 0
    cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=match.device_indices))
    assert clock.calls == 1
    assert len({n.last_access_time for n in path}) == 1
    stack.close()


def test_upstream_reads_the_clock_per_node(gloo_world1, monkeypatch):
    stack = _build(gloo_world1, upstream=True)
    tokens = _deep_path(stack)
    clock = CountingClock(time.monotonic)
    monkeypatch.setattr(time, "monotonic", clock)
    stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    assert clock.calls == DEPTH + 1  # what the patch removes
    stack.close()


# ------------------------------------------------------------------ frozen-clock twin
def _rows(cache) -> list:
    rows, todo = [], [cache.root_node]
    while todo:
        node = todo.pop()
        rows.append(
            (
                node.id,
                tuple(node.key.token_ids),
                None if node.value is None else tuple(torch.as_tensor(node.value).tolist()),
                None if node.host_value is None else tuple(torch.as_tensor(node.host_value).tolist()),
                node.hash_value,
                node.last_access_time,
                node.hit_count,
                node.priority,
                node.lock_ref,
            )
        )
        todo.extend(node.children.values())
    return sorted(rows, key=lambda row: row[0]) + [cache.evictable_size()]


def _scenario(stack, clock) -> list:
    """Steps touching every branch of the walks; returns the tree after each."""
    cache = stack.cache
    base = list(range(1000, 1000 + 4 * PS))
    host_only = list(range(5000, 5000 + 2 * PS))
    steps = [
        lambda: _insert(stack, base, priority=2),
        lambda: _insert(stack, base[: 2 * PS] + list(range(2000, 2000 + PS))),  # device split
        lambda: _insert(stack, base, chunked=True),
        lambda: cache.evict(EvictParams(num_tokens=10**6)),
        lambda: cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(base[:PS] + [7] * PS))),
        lambda: _insert(stack, base[:PS] + list(range(3000, 3000 + PS)), priority=5),  # host split + revive
        lambda: _insert(stack, base),  # revive the rest of the path
        lambda: cache._insert_helper_host(
            cache.root_node,
            nsa_stack.radix_key(host_only),
            cache.cache_controller.mem_pool_host.alloc(len(host_only)),
            ["h0", "h1"],
        ),
        lambda: cache._insert_helper_host(  # splits the host-only node, adds a host leaf
            cache.root_node,
            nsa_stack.radix_key(host_only[:PS] + list(range(6000, 6000 + PS))),
            cache.cache_controller.mem_pool_host.alloc(2 * PS),
            ["h0", "h2"],
        ),
        lambda: cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(host_only))),
    ]
    states = []
    for step in steps:
        clock.now += 1.0
        step()
        states.append(_rows(cache))
    return states


def test_frozen_clock_twin_matches_upstream(gloo_world1, monkeypatch):
    clock = type("Frozen", (), {"now": 1.0, "__call__": lambda self: self.now})()
    monkeypatch.setattr(time, "monotonic", clock)
    states = []
    for upstream in (False, True):
        stack = _build(gloo_world1, upstream=upstream)
        clock.now = 1.0
        TreeNode.counter = stack.cache.root_node.id + 1
        states.append(_scenario(stack, clock))
        stack.close()
    assert states[0] == states[1]


def test_equal_timestamps_evict_in_node_id_order_without_cp(gloo_world1):
    stack = _build(gloo_world1)
    cache = stack.cache
    assert isinstance(cache.eviction_strategy, NodeIdTieBreak)
    prompts = [list(range(i * 1000, i * 1000 + PS)) for i in range(1, 5)]
    for prompt in prompts:
        _insert(stack, prompt)
    for prompt in reversed(prompts):  # LRU order is now the reverse of node-id order
        cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(prompt)))
    nodes = [cache.root_node.children[nsa_stack.radix_key(p).child_key(PS)] for p in prompts]
    tie = time.monotonic() + 100.0  # one later access time for all: a tie
    for node in nodes:
        node.last_access_time = tie
    evicted = []
    for _ in nodes:
        cache.evict(EvictParams(num_tokens=1))
        evicted += [n.id for n in nodes if n.evicted and n.id not in evicted]
    assert evicted == sorted(n.id for n in nodes)
    stack.close()
