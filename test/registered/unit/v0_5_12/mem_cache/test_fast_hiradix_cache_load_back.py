"""Load-back locks the cached ancestors once and ends in upstream's tree state.

Upstream ``HiRadixCache.load_back`` locks the cached ancestors, unlocks them after the
load, then locks the path from the hit node to the root: three walks over the ancestors.
Ours keeps the first lock. On a chain whose deepest nodes were evicted to host, both
caches load the same node back; afterwards every node's lock count and residency, the
evictable/protected sizes and both leaf sets are equal, and ours visited each ancestor
once. The CP-mode test checks the same on rank 0 of cp 2.
"""

from __future__ import annotations

import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)

from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
CHAIN_PAGES = 8
EVICTED_PAGES = 3
TOKENS = list(range(1, CHAIN_PAGES * PS + 1))


def build_chain(stack) -> None:
    """One node per page, each a child of the previous, all backed up on host; then
    the deepest ``EVICTED_PAGES`` nodes evicted to host."""
    cache = stack.cache
    for pages in range(1, CHAIN_PAGES + 1):
        key = nsa_stack.radix_key(TOKENS[: pages * PS])
        cached = cache.match_prefix(MatchPrefixParams(key=key)).device_indices
        value = torch.cat([cached, stack.allocator.alloc(PS)])
        cache.insert(InsertParams(key=key, value=value))
        cache.check_hicache_events()
    cache.writing_check(write_back=True)
    cache.evict(EvictParams(num_tokens=EVICTED_PAGES * PS))


def load_back_counting_visits(cache):
    """Load the whole chain back; return the loaded locs, leaf-status updates per node
    and :func:`chain_state` while the load holds its locks."""
    visits = {}
    update = cache._update_leaf_status

    def counting(node):
        visits[node.id] = visits.get(node.id, 0) + 1
        return update(node)

    match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(TOKENS)))
    assert match.host_hit_length == EVICTED_PAGES * PS
    cache._update_leaf_status = counting
    try:
        loaded, last = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length
            )
        )
    finally:
        del cache._update_leaf_status
    locked_state = chain_state(cache)
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    assert last is match.best_match_node
    return loaded, visits, locked_state


def chain_state(cache) -> list:
    """Per depth: lock count, residency; then sizes and leaf sets (by depth, not id)."""
    nodes, node = [], cache.root_node
    while node.children:
        (node,) = node.children.values()
        nodes.append(node)
    depth = {node.id: d for d, node in enumerate(nodes)}
    return [(n.lock_ref, n.evicted, n.backuped) for n in nodes] + [
        cache.evictable_size(),
        cache.protected_size(),
        sorted(depth[n.id] for n in cache.evictable_leaves),
        sorted(depth[n.id] for n in cache.evictable_host_leaves),
    ]


def test_load_back_walks_ancestors_once_and_matches_upstream(gloo_world1):
    cfg = nsa_stack.StackConfig(physical_tokens=PS * 16, layer_num=1)
    ours = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False, cache_cls=CpHiRadixCache)
    upstream = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False)
    assert type(upstream.cache) is not CpHiRadixCache
    results = {}
    for name, stack in (("ours", ours), ("upstream", upstream)):
        build_chain(stack)
        loaded, visits, locked_state = load_back_counting_visits(stack.cache)
        assert len(loaded) == EVICTED_PAGES * PS
        results[name] = (locked_state, sorted(visits.values()), chain_state(stack.cache))

    ancestors = CHAIN_PAGES - EVICTED_PAGES
    assert results["ours"][0] == results["upstream"][0]  # while the load holds its locks
    assert results["ours"][2] == results["upstream"][2]  # after the load's ack
    assert results["ours"][1] == [1] * CHAIN_PAGES  # every node of the path, once
    assert results["upstream"][1] == [1] * EVICTED_PAGES + [3] * ancestors
    locked = results["ours"][0]
    assert locked[:CHAIN_PAGES] == [(1, False, True)] * CHAIN_PAGES
    assert locked[CHAIN_PAGES:] == [0, CHAIN_PAGES * PS, [], []]
    ours.close()
    upstream.close()


def test_cp_load_back_walks_ancestors_once(gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    build_chain(stack)
    free_before = stack.allocator.available_size()

    loaded, visits, locked = load_back_counting_visits(stack.cache)

    assert len(loaded) == EVICTED_PAGES * PS
    assert stack.allocator.available_size() == free_before - EVICTED_PAGES * PS
    assert sorted(visits.values()) == [1] * CHAIN_PAGES
    assert locked[:CHAIN_PAGES] == [(1, False, True)] * CHAIN_PAGES
    assert locked[CHAIN_PAGES:] == [0, CHAIN_PAGES * PS, [], []]
    unlocked = chain_state(stack.cache)
    assert unlocked[:CHAIN_PAGES] == [(0, False, True)] * CHAIN_PAGES
    assert unlocked[CHAIN_PAGES:] == [CHAIN_PAGES * PS, 0, [CHAIN_PAGES - 1], []]
    stack.close()
