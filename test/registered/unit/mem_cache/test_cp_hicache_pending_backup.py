"""CP backups pending until their final ack: invisible, committed, rolled back, host-full
retry, split deferral (bs > 1 shape through SGLang's PrefillAdder), chunked prefill."""

import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder
from sglang.srt.mem_cache.base_prefix_cache import (
    EvictParams,
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_cp_hicache.managers.schedule_policy import add_one_req_around
from sglang_cp_hicache.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.testing import device_module, nsa_stack

PS = 64


def _stack(gloo_world1, shared_kv=True, **cfg):
    cfg = nsa_stack.StackConfig(cp_size=2, **{"physical_tokens": PS * 16, **cfg})
    return nsa_stack.build_rank_stack(
        cfg, 0, None, gloo_world1, shared_kv=shared_kv, cache_cls=CpHiRadixCache
    )


@pytest.fixture
def stack(gloo_world1):
    stack = _stack(gloo_world1)
    yield stack
    stack.close()


def _tokens(start, num_pages):
    return list(range(start, start + num_pages * PS))


def _match(cache, tokens, req=None):
    return cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens), req=req))


def _host_free(stack):
    return stack.cache.token_to_kv_pool_host.available_size(), stack.cache.host_table.lane_free_pages()


def _locks_clear(cache):
    """No lock left anywhere: every cached token is evictable again."""
    return cache.protected_size_ == 0


# --------------------------------------------------------- pending visibility
def test_pending_backup_is_invisible_until_its_ack_commits_it(stack):
    cache = stack.cache
    tokens = _tokens(100, 3)
    with device_module().hold_events() as hold:
        node = nsa_stack.insert_at_root(stack, tokens)
        cache.check_hicache_events()  # in flight: nothing commits
        record = cache.pending_backups[node.id]
        assert record.submitted and node.host_value is None and not node.backuped
        assert _match(cache, tokens).last_host_node is cache.root_node
        cache.evict(EvictParams(num_tokens=10**6))  # locked by the write: stays on device
        assert not node.evicted and node not in cache.evictable_host_leaves
        assert cache.pending_stats.committed == 0
        hold.release()
    cache.check_hicache_events()
    assert node.backuped and torch.equal(node.host_value, record.write.logical_host_locs)
    assert node.cp_host_lanes == record.write.plan.lane_pages
    assert node.id not in cache.pending_backups and cache.pending_stats.committed == 1
    assert _match(cache, tokens).last_host_node is node and _locks_clear(cache)


def test_unsubmitted_reservation_rolls_back_to_the_start_counts(stack):
    cache = stack.cache
    node = nsa_stack.insert_at_root(stack, _tokens(1, 3))
    cache.check_hicache_events()
    cache.cache_controller.release_host(node.host_value, node.id)  # make it re-reservable
    node.host_value = None
    start = _host_free(stack)
    record = cache._reserve_backup(node)
    assert record is not None and not record.submitted and _host_free(stack) != start
    assert not node.backuped and cache._pending_write_id(node) == node.id
    cache._rollback_backup(record)
    assert _host_free(stack) == start
    assert node.id not in cache.pending_backups and cache.pending_stats.rolled_back == 1
    assert not node.backuped and _locks_clear(cache)


def test_flush_with_backups_in_flight_returns_every_host_slot(stack):
    cache = stack.cache
    start = _host_free(stack), stack.allocator.available_size()
    with device_module().hold_events():
        for i in range(3):
            nsa_stack.insert_at_root(stack, _tokens(1000 * (i + 1), 2))
        cache.check_hicache_events()
        assert len(cache.pending_backups) == 3
        cache.reset()  # the scheduler's flush_cache: the cache, then the device allocator
        stack.allocator.clear()
    assert (_host_free(stack), stack.allocator.available_size()) == start
    assert not cache.pending_backups and cache.pending_stats.rolled_back == 3


# --------------------------------------------------------------- host full
def _lane0_nodes(stack, count, host_only, start=100):
    """``count`` one-page nodes on lane 0; host-only ones are backed up and evicted."""
    cache = stack.cache
    nodes = []
    for i in range(count):
        locs = stack.allocator.alloc_pages_with_owners(torch.zeros(1, dtype=torch.int64))
        nodes.append(nsa_stack.insert_at_root(stack, _tokens(start + i * 2 * PS, 1), locs))
        if host_only:
            cache.check_hicache_events()
            cache.evict(EvictParams(num_tokens=10**6))
    return nodes


def _spy_reservations(monkeypatch, controller):
    results = []
    real = controller.reserve_write

    def spy(plan, node_id=-1, **kwargs):
        pending = real(plan, node_id, **kwargs)
        results.append((node_id, pending is not None))
        return pending

    monkeypatch.setattr(controller, "reserve_write", spy)
    return results


def test_full_host_lane_evicts_a_host_only_victim_and_retries_once(gloo_world1, monkeypatch):
    stack = _stack(gloo_world1, hicache_ratio=1.25)
    cache = stack.cache
    victims = _lane0_nodes(stack, cache.host_table.physical_host_pages, host_only=True)
    assert cache.host_table.lane_free_pages()[0] == 0
    reservations = _spy_reservations(monkeypatch, cache.cache_controller)
    locs = stack.allocator.alloc_pages_with_owners(torch.zeros(1, dtype=torch.int64))
    new = nsa_stack.insert_at_root(stack, _tokens(90000, 1), locs)
    assert reservations == [(new.id, False), (new.id, True)]  # refused, room made, retried
    assert new.id in cache.pending_backups
    assert victims[0] not in cache.root_node.children.values()  # the LRU host-only node
    cache.check_hicache_events()
    assert new.backuped and cache.capacity_refusals.host_writes == 0
    stack.close()


def test_full_host_lane_without_host_only_victims_skips_cleanly(gloo_world1, monkeypatch):
    stack = _stack(gloo_world1, hicache_ratio=1.25)
    cache = stack.cache
    lane_pages = cache.host_table.physical_host_pages
    host_only = _lane0_nodes(stack, lane_pages - 4, host_only=True)
    for node in host_only:
        node.protect_host()  # e.g. being loaded: not host-evictable
    with device_module().hold_events() as hold:
        pending = _lane0_nodes(stack, 4, host_only=False, start=10**6)  # in flight
        assert all(n.id in cache.pending_backups for n in pending)
        assert cache.host_table.lane_free_pages()[0] == 0
        start = _host_free(stack)
        reservations = _spy_reservations(monkeypatch, cache.cache_controller)
        locs = stack.allocator.alloc_pages_with_owners(torch.zeros(1, dtype=torch.int64))
        new = nsa_stack.insert_at_root(stack, _tokens(90000, 1), locs)
        assert reservations and not any(ok for _, ok in reservations) and len(reservations) <= 2
        assert _host_free(stack) == start  # nothing evicted, nothing left reserved
        assert new.id not in cache.pending_backups and new.lock_ref == 0
        assert all(n.id in cache.pending_backups for n in pending)  # untouched
        hold.release()
    cache.check_hicache_events()
    assert not new.backuped and not new.evicted  # device-valid, host-none
    assert cache.capacity_refusals.host_writes == 1
    assert all(n.backuped for n in pending) and _locks_clear(cache)
    for node in host_only:
        node.release_host()
    stack.close()


# ------------------------------------------------------------ split deferral
def _req(rid, tokens):
    return Req(rid=rid, origin_input_text="", origin_input_ids=list(tokens), sampling_params=SamplingParams())


def _adder(stack):
    return PrefillAdder(
        page_size=PS,
        tree_cache=stack.cache,
        token_to_kv_pool_allocator=stack.allocator,
        running_batch=None,
        new_token_ratio=0.0,
        rem_input_tokens=10**6,
        rem_chunk_tokens=None,
    )


def _add(adder, req):
    """One admission through the plugin's hook around SGLang's own add_one_req."""
    return add_one_req_around(PrefillAdder.add_one_req, adder, req, has_chunked_req=False, truncation_align_size=None)


@pytest.fixture
def scheduler_args(monkeypatch):
    """PrefillAdder reads the scheduler's global ServerArgs (NSA CP off here)."""
    from sglang.srt import server_args as server_args_module

    args = nsa_stack._server_args(nsa_stack.StackConfig())
    monkeypatch.setattr(server_args_module, "_global_server_args", args)


def test_request_that_would_split_a_pending_backup_waits_a_round(stack, scheduler_args):
    """bs > 1: A owns the pending backup, B would split it, C is unrelated."""
    cache = stack.cache
    tokens_a = _tokens(1, 4)
    with device_module().hold_events() as hold:
        node_a = nsa_stack.insert_at_root(stack, tokens_a)  # A's prefill, inserted
        cache.inc_lock_ref(node_a)  # A keeps running (decode) on its node
        record = cache.pending_backups[node_a.id]
        cache.check_hicache_events()  # round 2 starts; A's backup is still in flight
        req_b = _req("b", tokens_a[: 2 * PS] + _tokens(50000, 1) + [7])
        req_c = _req("c", _tokens(70000, 2) + [7])
        adder = _adder(stack)
        for req in (req_b, req_c):
            req.init_next_round_input(cache)
        assert len(req_b.prefix_indices) == 0 and req_b.last_node is cache.root_node
        assert len(node_a.key) == 4 * PS  # not split
        assert _add(adder, req_b) == AddReqResult.CONTINUE
        assert _add(adder, req_c) == AddReqResult.CONTINUE
        assert adder.can_run_list == [req_c]  # B stays waiting, holding no lock
        assert cache.pending_backups[node_a.id] is record and not cache._pending_fragments
        assert cache.pending_stats.deferred_splits == 1
        hold.release()
    cache.check_hicache_events()  # round 3: A's backup commits, B is matched again
    assert node_a.backuped
    req_b.init_next_round_input(cache)
    assert len(req_b.prefix_indices) == 2 * PS  # split now, after the commit
    adder = _adder(stack)
    assert _add(adder, req_b) == AddReqResult.CONTINUE and adder.can_run_list == [req_b]
    for req in (req_b, req_c):
        cache.dec_lock_ref(req.last_node)
    cache.dec_lock_ref(node_a)
    assert _locks_clear(cache)
    assert all(n.lock_ref == 0 for n in (node_a, node_a.parent))


# ------------------------------------------------------------- chunked prefill
@pytest.mark.parametrize("shared_kv", [True, False], ids=["cp_on", "cp_off"])
def test_chunked_prompt_comes_back_from_host_after_device_eviction(gloo_world1, shared_kv):
    stack = _stack(gloo_world1, shared_kv)
    cache = stack.cache
    tokens = _tokens(3, 6)
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    locs = stack.allocator.alloc(len(tokens))
    nsa_stack.write_prefill_kv(stack, locs, ids, pos)
    for end in (2 * PS, 4 * PS, 6 * PS):  # cache_unfinished_req after each chunk
        key = nsa_stack.radix_key(tokens[:end])
        cache.insert(InsertParams(key=key, value=locs[:end].clone(), chunked=True))
        cache.check_hicache_events()
    cache.evict(EvictParams(num_tokens=10**6))
    nsa_stack.wipe_device_kv(stack)
    match = _match(cache, tokens)
    assert len(match.device_indices) == 0 and match.host_hit_length == 6 * PS
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
    )
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    assert len(loaded) == 6 * PS
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0
    stack.close()
