"""Upstream fixes that sglang 0.5.12.post1 already has; these tests keep them fixed in our walks.

Each runs on upstream ``HiRadixCache`` and on ours with CP off and on (our tree walks
replace upstream's, so they must keep the same guards):

* ghost node: ``TreeNode.children`` is a defaultdict; a miss lookup must neither create a
  child nor bump ``TreeNode.counter`` (node ids are ack ids and must agree across ranks);
* short bigram keys (EAGLE): a key with fewer than ``page_size + 1`` raw tokens has no
  full page and must match/insert nothing instead of raising in ``child_key``;
* lock-ref changes update the evictable leaf sets and sizes along the whole path, so no
  locked node is evictable and no unlocked leaf is missing ("phantom" evictable size).
"""

from __future__ import annotations

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixKey, TreeNode

from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
VARIANTS = ["upstream", "cp_off", "cp_on"]


def _stack(gloo_world1, variant: str):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, layer_num=1)
    if variant == "cp_on":
        return nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    cache_cls = CpHiRadixCache if variant == "cp_off" else None
    return nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False, cache_cls=cache_cls)


@pytest.fixture(params=VARIANTS)
def stack(request, gloo_world1):
    stack = _stack(gloo_world1, request.param)
    yield stack
    stack.close()


def _insert(stack, key: RadixKey):
    locs = stack.allocator.alloc(len(key.token_ids))
    result = stack.cache.insert(InsertParams(key=key, value=locs))
    stack.cache.check_hicache_events()
    return result


def _match(stack, key: RadixKey):
    return stack.cache.match_prefix(MatchPrefixParams(key=key))


def _all_nodes(cache) -> list:
    nodes, todo = [], [cache.root_node]
    while todo:
        node = todo.pop()
        nodes.append(node)
        todo.extend(node.children.values())
    return nodes


def _assert_no_ghosts(cache) -> None:
    for node in _all_nodes(cache):
        for child_key, child in node.children.items():
            assert child.parent is node and child.key is not None
            assert child.key.child_key(cache.page_size) == child_key


# ------------------------------------------------------------------ ghost node
def test_miss_lookups_create_no_node(stack):
    cache = stack.cache
    shared = list(range(100, 100 + PS))
    _insert(stack, nsa_stack.radix_key(shared + list(range(200, 200 + PS))))
    _insert(stack, nsa_stack.radix_key(shared + list(range(300, 300 + PS))))
    cache.evict(EvictParams(num_tokens=PS))  # one branch host-only: walks see both kinds
    counter, nodes = TreeNode.counter, len(_all_nodes(cache))
    misses = [
        list(range(900, 900 + 2 * PS)),  # miss at the root
        shared + list(range(900, 900 + PS)),  # miss at an inner node
        shared + list(range(200, 200 + PS)) + list(range(900, 900 + PS)),  # past a leaf
        shared + list(range(300, 300 + PS)) + list(range(900, 900 + PS)),
    ]
    for tokens in misses:
        match = _match(stack, nsa_stack.radix_key(tokens))
        assert len(match.device_indices) + match.host_hit_length <= 2 * PS
    assert TreeNode.counter == counter and len(_all_nodes(cache)) == nodes
    _assert_no_ghosts(cache)


# ------------------------------------------------------------------ short bigram keys
def _bigram(tokens) -> RadixKey:
    return RadixKey(list(tokens), None, is_bigram=True)


def test_short_bigram_keys_match_and_insert_nothing(stack):
    cache = stack.cache
    cache.is_eagle = True  # what CacheInitParams(is_eagle=True) sets
    counter = TreeNode.counter
    for raw_len in (0, 1, 2, PS - 1, PS):  # fewer than PS bigrams: no full page
        tokens = range(7, 7 + raw_len)
        match = _match(stack, _bigram(tokens))
        assert len(match.device_indices) == 0 and match.host_hit_length == 0
        assert cache.insert(InsertParams(key=_bigram(tokens), value=torch.arange(raw_len))).prefix_len == 0
    assert TreeNode.counter == counter and not cache.root_node.children

    page = list(range(7, 7 + PS + 1))  # PS + 1 raw tokens: exactly one bigram page
    _insert(stack, _bigram(page))
    assert len(_match(stack, _bigram(page)).device_indices) == PS
    for tail in (1, 2, PS // 2, PS):  # the part past the first page is again short
        tokens = page + list(range(5000, 5000 + tail))
        assert len(_match(stack, _bigram(tokens)).device_indices) == PS
        assert _insert(stack, _bigram(tokens)).prefix_len == PS
    _assert_no_ghosts(cache)


# ------------------------------------------------------------------ lock-ref leaf status
def _expected_leaves(cache):
    device, host, evictable = set(), set(), 0
    for node in _all_nodes(cache):
        if node is cache.root_node or node.lock_ref > 0:
            continue
        if not node.evicted:
            evictable += len(node.value)
            if all(child.evicted for child in node.children.values()):
                device.add(node)
        elif not any(child.backuped for child in node.children.values()):
            host.add(node)
    return device, host, evictable


def _assert_leaf_status(cache) -> None:
    device, host, evictable = _expected_leaves(cache)
    assert set(cache.evictable_leaves) == device
    assert set(cache.evictable_host_leaves) == host
    assert cache.evictable_size() == evictable


def test_lock_ref_changes_update_evictable_leaves(stack):
    cache = stack.cache
    base = list(range(1000, 1000 + 2 * PS))
    branches = [base + list(range(i * 100, i * 100 + PS)) for i in range(2, 5)]
    for tokens in branches:
        _insert(stack, nsa_stack.radix_key(tokens))
    cache.evict(EvictParams(num_tokens=PS))  # one branch leaf host-only
    _assert_leaf_status(cache)
    leaves = [_match(stack, nsa_stack.radix_key(t)).last_device_node for t in branches]

    locked = leaves[1]
    cache.inc_lock_ref(locked)
    _assert_leaf_status(cache)
    assert locked not in cache.evictable_leaves and locked.parent.lock_ref == 1
    cache.evict(EvictParams(num_tokens=10**6))  # takes everything but the locked path
    assert not locked.evicted and not locked.parent.evicted
    _assert_leaf_status(cache)

    cache.dec_lock_ref(locked)
    _assert_leaf_status(cache)
    assert locked in cache.evictable_leaves
    cache.evict(EvictParams(num_tokens=10**6))
    assert locked.evicted and locked.parent.evicted
    _assert_leaf_status(cache)


def test_eviction_returns_every_page_of_split_multi_page_nodes(stack):
    """Batched eviction frees each evicted node's whole pages (one loc per page reaches the
    allocator) and no others: after evicting everything, every slot is free exactly once."""
    allocator = stack.allocator
    start = allocator.available_size()
    shared = list(range(1, 1 + PS))
    _insert(stack, RadixKey(shared + list(range(1000, 1000 + 2 * PS))))
    second = RadixKey(shared + list(range(2000, 2000 + 3 * PS)))
    locs = allocator.alloc(len(second.token_ids))
    result = stack.cache.insert(InsertParams(key=second, value=locs))  # splits the first
    stack.cache.check_hicache_events()
    assert result.prefix_len == PS
    allocator.free(locs[:PS])  # the caller frees what the tree already held
    assert allocator.available_size() == start - 6 * PS
    stack.cache.evict(EvictParams(num_tokens=10**6))
    assert allocator.available_size() == start
    locs = allocator.alloc(start)
    assert locs is not None and len(torch.unique(locs)) == start
