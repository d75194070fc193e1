"""CpHiRadixCache capacity policy: every decision per owner lane, on the real NSA stack.

Host room for a backup and device room for a load-back are made only from leaves that
hold pages on a short lane; when those cannot cover the shortfall nothing is evicted and
the backup or load is refused (counted). The write-back sequence and the pending split
run with the flag off too (the flag-off class replaces upstream's).
"""

import pytest
import torch
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.hiradix_cache import StorageMedium

from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


def _stack(gloo_world1, shared_kv=True, **cfg):
    return nsa_stack.unit_stack(gloo_world1, shared_kv, **cfg)


class Prompts:
    """Distinct prompts, prefilled on pages of chosen owner lanes (or plain pages)."""

    def __init__(self, stack):
        self.stack = stack
        self.next_token = 1000

    def prefill(self, num_pages=None, owners=None):
        if owners is not None:
            locs = self.stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        else:
            locs = self.stack.allocator.alloc(num_pages * PS)
        tokens = list(range(self.next_token, self.next_token + len(locs)))
        self.next_token += len(locs) + 1
        ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
        nsa_stack.write_prefill_kv(self.stack, locs, ids, pos)
        self.stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
        self.stack.cache.check_hicache_events()
        return tokens, self.node(tokens)

    def node(self, tokens):
        return self.stack.cache.root_node.children.get(nsa_stack.radix_key(tokens).child_key(PS))

    def load_back(self, tokens):
        cache = self.stack.cache
        match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
        loaded, _ = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=match.best_match_node, host_hit_length=match.host_hit_length
            )
        )
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()
        return loaded


def _in_tree(node):
    return node.parent.children.get(node.key.child_key(PS)) is node


def _host_only(stack, prompts, count, owners):
    """``count`` backed-up host-only nodes on pages of ``owners``, oldest first."""
    nodes = []
    for _ in range(count):
        nodes.append(prompts.prefill(owners=owners)[1])
        stack.cache.evict(EvictParams(num_tokens=10**9))
    assert all(n.evicted and n.backuped for n in nodes)
    return nodes


# ------------------------------------------------------------------- host tier
def test_host_room_is_made_only_from_the_short_lane(gloo_world1):
    stack = _stack(gloo_world1, hicache_ratio=1.25)
    table, prompts = stack.cache.host_table, Prompts(stack)
    lane_pages = table.physical_host_pages
    lane1 = _host_only(stack, prompts, 4, [1])  # the oldest host nodes: lane 1 only
    lane0 = _host_only(stack, prompts, lane_pages, [0])  # host lane 0 now full
    assert table.lane_free_pages() == [0, lane_pages - 4]

    _, new = prompts.prefill(owners=[0])

    assert new.backuped  # backed up once lane-0 room was made
    assert all(_in_tree(n) for n in lane1)  # they free nothing on lane 0: never victims
    assert [n for n in lane0 if not _in_tree(n)] == lane0[:1]  # the LRU lane-0 node only
    assert table.lane_free_pages() == [0, lane_pages - 4]
    assert stack.cache.capacity_refusals.host_writes == 0
    stack.close()


def test_host_shortfall_that_cannot_be_covered_evicts_nothing(gloo_world1, caplog):
    stack = _stack(gloo_world1, hicache_ratio=1.25)
    table, prompts = stack.cache.host_table, Prompts(stack)
    lane1 = _host_only(stack, prompts, 4, [1])
    lane0 = _host_only(stack, prompts, table.physical_host_pages, [0])
    for node in lane0:
        node.protect_host()  # e.g. being loaded: not host-evictable
    host_free = stack.cache.token_to_kv_pool_host.available_size()

    with caplog.at_level("WARNING"):
        _, new = prompts.prefill(owners=[0])

    assert not new.backuped and not new.evicted  # device-only, as upstream on a full host
    assert all(_in_tree(n) for n in lane0 + lane1)  # nothing evicted for the refusal
    assert stack.cache.token_to_kv_pool_host.available_size() == host_free
    assert stack.cache.capacity_refusals.host_writes == 1
    assert "refused" in caplog.text
    for node in lane0:
        node.release_host()
    stack.close()


def test_reset_empties_every_host_lane(gloo_world1):
    stack = _stack(gloo_world1)
    prompts = Prompts(stack)
    _host_only(stack, prompts, 3, [0, 1, 1])
    assert stack.cache.cp_host_usage()["logical_tokens"] == 9 * PS
    stack.cache.reset()
    usage = stack.cache.cp_host_usage()
    assert usage["logical_tokens"] == 0 and usage["lane_used_pages"] == [0, 0]
    assert stack.cache.host_table.lane_free_pages() == [stack.cache.host_table.physical_host_pages] * 2
    stack.close()


# ----------------------------------------------------------------- device tier
def test_load_back_evicts_only_device_cache_on_its_short_lane(gloo_world1):
    stack = _stack(gloo_world1, physical_tokens=PS * 8)
    allocator, prompts = stack.allocator, Prompts(stack)
    target, node = prompts.prefill(owners=[0, 0, 1, 1])
    ids = torch.tensor(target)
    stack.cache.evict(EvictParams(num_tokens=10**9))
    _, old_lane1 = prompts.prefill(owners=[1])  # least recently used, lane 1 only
    _, lane0 = prompts.prefill(owners=[0] * allocator.lane_free_pages()[0])
    held = allocator.alloc_pages_with_owners([1] * (allocator.lane_free_pages()[1] - 2))
    assert allocator.lane_free_pages() == [0, 2]
    nsa_stack.wipe_device_kv(stack)

    loaded = prompts.load_back(target)

    assert len(loaded) == 4 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, torch.arange(len(ids))) == 0
    assert not old_lane1.evicted  # frees nothing on lane 0
    assert lane0.evicted
    allocator.free(held)
    stack.close()


def test_load_back_that_no_eviction_can_serve_evicts_nothing(gloo_world1):
    stack = _stack(gloo_world1, physical_tokens=PS * 8)
    allocator, prompts = stack.allocator, Prompts(stack)
    target, _ = prompts.prefill(owners=[0, 0])
    stack.cache.evict(EvictParams(num_tokens=10**9))
    _, cached = prompts.prefill(owners=[1, 1])  # evictable, but lane 1
    held = allocator.alloc_pages_with_owners([0] * allocator.lane_free_pages()[0])
    evictable = stack.cache.evictable_size()

    loaded = prompts.load_back(target)

    assert len(loaded) == 0
    assert not cached.evicted and stack.cache.evictable_size() == evictable
    assert stack.cache.capacity_refusals.device_loads == 1
    allocator.free(held)
    stack.close()


# ------------------------------------------------------------------ write-back
@pytest.mark.parametrize("shared_kv", [True, False], ids=["cp_on", "cp_off"])
def test_write_back_load_back_never_frees_the_pages_it_loads(gloo_world1, shared_kv):
    """The load's device room comes from write-back victims, whose backups need host room;
    the node being loaded is the only host node not in use, so it must not be that room:
    the load is refused, and succeeds with the written bytes once other room exists."""
    stack = _stack(gloo_world1, shared_kv, physical_tokens=PS * 8, hicache_ratio=1.5,
                   write_policy="write_back")  # fmt: skip
    cache, prompts = stack.cache, Prompts(stack)
    device_pages = stack.allocator.available_size() // PS
    host_pages = cache.token_to_kv_pool_host.size // PS * (2 if shared_kv else 1)
    target, node = prompts.prefill(4)  # backed up when evicted (write-back)
    cache.evict(EvictParams(num_tokens=10**9))
    fillers = []
    for _ in range((host_pages - 4) // 4):
        fillers.append(prompts.prefill(4)[1])
        cache.evict(EvictParams(num_tokens=10**9))
    assert cache.token_to_kv_pool_host.available_size() < 4 * PS  # host tier full
    for filler in fillers:
        filler.protect_host()  # in use (e.g. a prefetch): not host-evictable
    for _ in range(device_pages // 4):
        prompts.prefill(4)  # device full of nodes with no host copy yet
    nsa_stack.wipe_device_kv(stack)
    ids, positions = torch.tensor(target), torch.arange(len(target))

    assert len(prompts.load_back(target)) == 0  # no room anywhere but the target's pages
    assert node.backuped and _in_tree(node)

    for filler in fillers:
        filler.release_host()
    loaded = prompts.load_back(target)
    assert len(loaded) == 4 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, positions) == 0
    assert cache.evictable_size() + cache.protected_size() + stack.allocator.available_size() == (
        device_pages * PS
    )
    stack.close()


@pytest.mark.parametrize("write_policy", ["write_through", "write_back"])
def test_eviction_ties_break_by_node_id_for_both_write_policies(gloo_world1, write_policy):
    stack = _stack(gloo_world1, write_policy=write_policy)
    prompts = Prompts(stack)
    nodes = [prompts.prefill(1)[1] for _ in range(4)]
    for node in nodes:
        node.last_access_time = 1.0  # equal LRU priority everywhere
    order = []
    for _ in nodes:
        stack.cache.evict(EvictParams(num_tokens=1))
        order.append(next(n.id for n in nodes if n.evicted and n.id not in order))
    assert order == sorted(n.id for n in nodes)
    stack.close()


# ------------------------------------------------------------ pending splits
@pytest.mark.parametrize("shared_kv", [True, False], ids=["cp_on", "cp_off"])
def test_split_of_a_pending_backup_publishes_both_fragments(gloo_world1, monkeypatch, shared_kv):
    stack = _stack(gloo_world1, shared_kv)
    cache = stack.cache
    stored = []
    record = cache._record_store_event
    monkeypatch.setattr(
        cache, "_record_store_event",
        lambda node, medium=None: stored.append((node, medium)) or record(node, medium=medium),
    )  # fmt: skip
    tokens = list(range(5, 5 + 4 * PS))
    with device_module().hold_events() as hold:
        cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=stack.allocator.alloc(4 * PS)))
        cache.check_hicache_events()  # the write-through is still in flight
        tail = cache.root_node.children[nsa_stack.radix_key(tokens).child_key(PS)]
        if shared_kv:
            reserved = cache.pending_backups[tail.id].write.logical_host_locs
        # A request sharing the first two pages, inserted after its forward, splits it.
        other = tokens[: 2 * PS] + list(range(9000, 9000 + PS))
        other_locs = torch.cat([tail.value[: 2 * PS], stack.allocator.alloc(PS)])
        cache.insert(InsertParams(key=nsa_stack.radix_key(other), value=other_locs))
        head = tail.parent
        assert len(head.key) == len(tail.key) == 2 * PS
        assert head.backuped == tail.backuped == (not shared_kv)  # CP: pending until the ack
        hold.release()
    cache.check_hicache_events()
    published = [node for node, medium in stored if medium == StorageMedium.CPU]
    leaf = next(n for n in head.children.values() if n is not tail)  # backed up on its own
    assert sorted(n.id for n in published) == sorted([head.id, tail.id, leaf.id])
    assert head.lock_ref == tail.lock_ref == 0
    assert head.backuped and tail.backuped
    if shared_kv:  # the fragments took their slices of the one reservation
        assert torch.equal(torch.cat([head.host_value, tail.host_value]), reserved)
    stack.close()
