"""CpHiRadixCache in CP mode on the real NSA stack: host visibility, splits, load-back, host eviction, flush."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import CpHiCacheMetadataError
from sglang_cp_hicache.v0_5_12.server_args import CpSharedKVConfigError, validate_cp_shared_kv_args
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


def _stack(gloo_world1, cp_size=2, cp_rank=0, **cfg):
    cfg = nsa_stack.StackConfig(cp_size=cp_size, physical_tokens=PS * 16, **cfg)
    return nsa_stack.build_rank_stack(cfg, cp_rank, None, gloo_world1)


@pytest.fixture
def stack(gloo_world1):
    stack = _stack(gloo_world1)
    yield stack
    stack.close()


def _prefill(stack, tokens):
    """Allocate, write owned KV, insert as a finished request would, ack the write-through."""
    locs = stack.allocator.alloc(len(tokens))
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    nsa_stack.write_prefill_kv(stack, locs, ids, pos)
    stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
    stack.cache.check_hicache_events()
    return locs, ids, pos


def _node_of(stack, tokens):
    return stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens))).last_device_node


def _load_back(stack, tokens, mem_quota=None):
    match = stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    loaded, node = stack.cache.init_load_back(
        InitLoadBackParams(
            best_match_node=match.best_match_node,
            host_hit_length=match.host_hit_length,
            mem_quota=mem_quota,
        )
    )
    stack.cache.ready_to_load_host_cache()
    stack.cache.check_hicache_events()
    return match, loaded


def test_backed_up_cp_node_is_host_visible_with_logical_length(stack):
    tokens = list(range(100, 100 + 3 * PS))
    _prefill(stack, tokens)
    node = _node_of(stack, tokens)
    assert node.backuped and len(node.host_value) == 3 * PS
    meta = stack.cache.node_host_metadata(node)
    owned = stack.layout.owned_positions(node.value)
    assert torch.equal(meta.owned_positions, owned)
    stack.cache.evict(EvictParams(num_tokens=3 * PS))
    match = stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    assert len(match.device_indices) == 0 and match.host_hit_length == 3 * PS


def test_inc_hit_count_does_not_back_up_cp_node_twice(stack, monkeypatch):
    controller = stack.cache.cache_controller
    writes = []
    real_reserve = controller.reserve_write
    monkeypatch.setattr(
        controller, "reserve_write", lambda plan, node_id, **k: writes.append(node_id) or real_reserve(plan, node_id, **k)
    )
    tokens = list(range(7, 7 + 2 * PS))
    locs, _, _ = _prefill(stack, tokens)
    for _ in range(3):  # repeated inserts of the same prefix bump the hit count
        stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs.clone()))
    assert len(writes) == 1


def test_split_node_splits_host_metadata_at_page_boundary(stack):
    tokens = list(range(1, 1 + 4 * PS))
    _prefill(stack, tokens)
    node = _node_of(stack, tokens)
    before = stack.cache.node_host_metadata(node)
    stack.cache.evict(EvictParams(num_tokens=4 * PS))
    # A request sharing only the first two pages splits the evicted, backed-up node.
    other = tokens[: 2 * PS] + list(range(9000, 9000 + PS))
    _prefill(stack, other)
    parent = node.parent
    assert len(parent.key) == 2 * PS and len(node.key) == 2 * PS
    expected_parent, expected_child = before.split(2 * PS)
    for half, expected in ((parent, expected_parent), (node, expected_child)):
        actual = stack.cache.node_host_metadata(half)
        assert torch.equal(actual.owned_positions, expected.owned_positions)
        assert torch.equal(actual.host_indices, expected.host_indices)
        assert torch.equal(actual.page_owners, expected.page_owners)


def test_load_back_of_a_split_host_node_reads_its_half(stack):
    # A load reads the plan the split made for each half, not the node's backup-time plan.
    tokens = list(range(1, 1 + 4 * PS))
    _, ids, pos = _prefill(stack, tokens)
    node = _node_of(stack, tokens)
    stack.cache.evict(EvictParams(num_tokens=4 * PS))
    _prefill(stack, tokens[: 2 * PS] + list(range(9000, 9000 + PS)))  # splits, revives the head
    assert node.evicted and len(node.host_value) == 2 * PS
    nsa_stack.wipe_device_kv(stack)
    match, loaded = _load_back(stack, tokens)
    assert match.host_hit_length == 2 * PS and len(loaded) == 2 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids[2 * PS :], pos[2 * PS :]) == 0


def test_load_back_fails_fast_on_a_host_value_set_without_its_plan(stack):
    tokens = list(range(500, 500 + 2 * PS))
    _prefill(stack, tokens)
    node = _node_of(stack, tokens)
    stack.cache.evict(EvictParams(num_tokens=2 * PS))
    node.host_value = node.host_value[:PS].clone()  # as a path that skips _set_host_plan
    node.key = node.key[:PS]
    with pytest.raises(CpHiCacheMetadataError, match=f"node {node.id} on CP rank 0"):
        _load_back(stack, tokens[:PS])


def test_load_back_uses_logical_host_lengths(stack):
    tokens = list(range(300, 300 + 5 * PS))
    _, ids, pos = _prefill(stack, tokens)
    node = _node_of(stack, tokens)
    owned_slots = stack.cache.node_host_metadata(node).owned_len
    assert 0 < owned_slots < 5 * PS  # this rank holds a strict subset
    stack.cache.evict(EvictParams(num_tokens=5 * PS))
    nsa_stack.wipe_device_kv(stack)
    match, loaded = _load_back(stack, tokens)
    assert match.host_hit_length == 5 * PS and len(loaded) == 5 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0


def test_host_eviction_frees_owned_slots_and_counts_lane_pages(gloo_world1):
    stack = _stack(gloo_world1, hicache_ratio=1.25)
    host = stack.cache.token_to_kv_pool_host
    table = stack.cache.cache_controller.host_table
    # Back up and device-evict prompts until every lane's host pages are nearly used.
    prompts = [list(range(i * 10000, i * 10000 + 4 * PS)) for i in range(table.physical_host_pages)]
    host_nodes, owned_slots = [], {}
    for prompt in prompts:
        _prefill(stack, prompt)
        node = _node_of(stack, prompt)
        host_nodes.append(node)
        owned_slots[node.id] = stack.cache.node_host_metadata(node).owned_len
        stack.cache.evict(EvictParams(num_tokens=4 * PS))
    assert max(table.lane_free_pages()) < 2

    def in_tree(n):
        return n.parent.children.get(n.key.child_key(PS)) is n

    host_nodes = [n for n in host_nodes if in_tree(n)]
    free_before = host.available_size()
    fresh = list(range(777777, 777777 + 4 * PS))  # needs 2 pages on each lane
    _prefill(stack, fresh)
    new_node = _node_of(stack, fresh)
    assert new_node.backuped
    victims = [n for n in host_nodes if not in_tree(n)]
    assert victims and len(victims) < len(host_nodes)  # evicted for the deficit only
    # Physical progress: exactly the victims' owned shards came back to this rank's pool.
    freed = sum(owned_slots[v.id] for v in victims)
    owned_new = stack.cache.node_host_metadata(new_node).owned_len
    assert host.available_size() == free_before + freed - owned_new
    assert table.lane_used_pages()[stack.layout.cp_rank] * PS == host.size - host.available_size()
    stack.close()


def test_in_flight_backup_is_not_host_visible(stack):
    tokens = list(range(40, 40 + 2 * PS))
    locs = stack.allocator.alloc(len(tokens))
    with device_module().hold_events() as hold:
        stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
        stack.cache.check_hicache_events()
        node = _node_of(stack, tokens)
        assert node.id in stack.cache.ongoing_write_through and node.lock_ref > 0
        stack.cache.evict(EvictParams(num_tokens=10**6))  # locked: stays on device
        match = stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
        assert len(match.device_indices) == 2 * PS and match.host_hit_length == 0
        assert node not in stack.cache.evictable_host_leaves
        hold.release()
    stack.cache.check_hicache_events()
    assert node.id not in stack.cache.ongoing_write_through and node.lock_ref == 0


def test_load_back_quota_counts_device_evictable_cache(stack):
    resident = list(range(50000, 50000 + 10 * PS))
    _prefill(stack, resident)  # device-resident, evictable
    target = list(range(60000, 60000 + 6 * PS))
    _, ids, pos = _prefill(stack, target)
    stack.cache.evict(EvictParams(num_tokens=1))  # LRU: evicts `resident` first...
    stack.cache.evict(EvictParams(num_tokens=10**6))  # ...then everything
    _prefill(stack, resident)
    # Fill the rest of the device pool so free slots alone cannot hold the load.
    filler = stack.allocator.alloc(stack.allocator.available_size() - 2 * PS)
    assert stack.allocator.available_size() < 6 * PS <= stack.allocator.available_size() + stack.cache.evictable_size()
    match, loaded = _load_back(stack, target)
    assert len(loaded) == 6 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0
    stack.allocator.free(filler)


def test_load_back_beyond_quota_is_skipped_cleanly(stack):
    target = list(range(70000, 70000 + 6 * PS))
    _prefill(stack, target)
    stack.cache.evict(EvictParams(num_tokens=10**6))
    filler = stack.allocator.alloc(stack.allocator.available_size() - PS)
    free_before = stack.allocator.available_size()
    match, loaded = _load_back(stack, target)
    assert match.host_hit_length == 6 * PS and len(loaded) == 0
    assert stack.allocator.available_size() == free_before
    assert _node_of(stack, target) is stack.cache.root_node
    stack.allocator.free(filler)


def test_storage_backend_is_refused(stack):
    with pytest.raises(CpSharedKVConfigError, match="storage backend"):
        stack.cache.attach_storage_backend("file")
    launch = SimpleNamespace(
        enable_nsa_prefill_cp_shared_kv=True,
        enable_nsa_prefill_context_parallel=True,
        hicache_storage_backend="file",
    )
    with pytest.raises(CpSharedKVConfigError, match="--hicache-storage-backend"):
        validate_cp_shared_kv_args(launch)


def test_kernel_page_first_is_refused_when_the_cache_is_built(gloo_world1):
    """No per-layer D2H op exists for it: refused with the remedy, never emulated."""
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, io_backend="kernel", mem_layout="page_first")
    with pytest.raises(CpSharedKVConfigError, match="per-layer.*'kernel'.*'page_first'.*layer_first"):
        nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)


def test_flush_returns_every_device_and_host_slot(stack):
    device_free = stack.allocator.available_size()
    host_free = stack.cache.token_to_kv_pool_host.available_size()
    for i in range(4):
        _prefill(stack, list(range(i * 5000, i * 5000 + 3 * PS)))
    stack.cache.evict(EvictParams(num_tokens=10**9))
    stack.cache.evict_host(10**9)
    assert stack.allocator.available_size() == device_free
    assert stack.cache.token_to_kv_pool_host.available_size() == host_free
    assert stack.cache.cp_host_usage()["logical_tokens"] == 0
