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

from sglang_cp_hicache.v0_5_12.managers.schedule_policy import add_one_req_around
from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack, scheduler_batch

PS = 64


def _stack(gloo_world1, shared_kv=True, **cfg):
    return nsa_stack.unit_stack(gloo_world1, shared_kv, **cfg)


@pytest.fixture
def stack(gloo_world1, plugins_loaded):
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
        assert node.id in cache.ongoing_write_through and node.host_value is None and not node.backuped
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
        assert cache.pending_backups[node_a.id] is record and node_a.parent is cache.root_node
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


def test_a_deferral_not_taken_in_its_round_ends_at_the_next_check(stack, scheduler_args):
    """A match deferred in round 2 but never admitted that round (its batch filled up) does
    not hold the request back in round 3: the next poll of the cache ends it."""
    cache = stack.cache
    tokens_a = _tokens(1, 4)
    with device_module().hold_events():
        node_a = nsa_stack.insert_at_root(stack, tokens_a)
        cache.inc_lock_ref(node_a)
        cache.check_hicache_events()  # round 2; A's backup is still in flight
        req_b = _req("b", tokens_a[: 2 * PS] + _tokens(50000, 1) + [7])
        req_b.init_next_round_input(cache)  # deferred, never reaches add_one_req
        assert cache.pending_stats.deferred_splits == 1
        cache.check_hicache_events()  # round 3; A's backup is still in flight
        assert not cache.take_split_deferral(req_b)
        req_b.init_next_round_input(cache)  # matched again: deferred again, taken once
        assert cache.take_split_deferral(req_b) and not cache.take_split_deferral(req_b)
        cache.flush_write_through_acks()  # decode's flush: after the round's admissions
        req_b.init_next_round_input(cache)
        cache.flush_write_through_acks()
        assert not cache.take_split_deferral(req_b)
    cache.check_hicache_events()
    cache.dec_lock_ref(node_a)
    assert _locks_clear(cache)


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


# -------------------------------------------------- reservation before the forward
class Scheduled:
    """One request between its scheduling (match, lock, slots) and its release
    (cache_finished_req), as the scheduler drives the cache; :meth:`forward` is the model
    forward (KV stored, then each layer's end reported as the NSA hook reports it)."""

    def __init__(self, stack, rid, tokens):
        cache = stack.cache
        self.stack, self.req = stack, _req(rid, tokens)
        req = self.req
        req.init_next_round_input(cache)  # match: prefix_indices, last_node, fill_ids
        cache.inc_lock_ref(req.last_node)
        self.prefix, seq_len = len(req.prefix_indices), len(req.fill_ids)
        # SGLang's alloc_for_extend: slots, req_to_token row and (hooked) its host mirror.
        with scheduler_batch.cpu_scheduler_server_args(PS):
            self.new_locs = scheduler_batch.alloc_for_extend(stack, [req], [seq_len])
        req.kv_committed_len = seq_len
        self.forwarded = False

    def forward(self, layers=None):
        """The batch's forward: KV stored, layer ends reported (all layers unless
        ``layers``); the forward end only after the last layer."""
        ids, pos = torch.tensor(self.req.fill_ids), torch.arange(len(self.req.fill_ids))
        nsa_stack.write_prefill_kv(self.stack, self.new_locs, ids[self.prefix :], pos[self.prefix :])
        pool = self.stack.kv_pool
        for layer in layers if layers is not None else range(pool.layer_num):
            cp_layer_backup.notify_layer_stored(pool, pool.start_layer + layer)
        if layers is None:
            cp_layer_backup.notify_forward_end(pool)
        self.forwarded = True

    def release(self, is_insert=True):
        if not self.forwarded:
            self.forward()
        self.stack.cache.cache_finished_req(self.req, is_insert=is_insert)
        self.stack.req_to_token_pool.free(self.req)


@pytest.fixture(params=[True, False], ids=["per_layer", "all_layer"])
def per_layer(request, stack):
    stack.cache.per_layer_backup = request.param
    return request.param


def _acked(cache):
    return [i for ack in cache.cache_controller.ack_write_queue for i in ack.node_ids]


def _loads_back_exact(stack, tokens):
    """Evict the device copy of ``tokens``, wipe device KV, load back: bytes match."""
    cache = stack.cache
    cache.evict(EvictParams(num_tokens=10**6))
    nsa_stack.wipe_device_kv(stack)
    match = _match(cache, tokens)
    assert len(match.device_indices) == 0 and match.host_hit_length == len(tokens)
    loaded, _ = cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
    )
    cache.ready_to_load_host_cache()
    cache.check_hicache_events()
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    assert len(loaded) == len(tokens)
    assert nsa_stack.count_kv_mismatches(stack, loaded, ids, pos) == 0


def test_reservation_before_the_forward_is_claimed_by_the_insert(stack, scheduler_args, per_layer):
    cache, controller = stack.cache, stack.cache.cache_controller
    start = _host_free(stack)
    a = Scheduled(stack, "a", _tokens(1, 3) + [7])
    assert cache.reserve_for_extend(a.req)
    reserved = cache.forward_reservations.get("a").write
    assert _host_free(stack) != start and not controller.ack_write_queue  # no transfer yet
    assert controller.held_write_node_ids == ([reserved.node_id] if per_layer else [])
    with device_module().hold_events() as hold:
        a.forward(layers=range(stack.kv_pool.layer_num - 1))
        assert not controller.ack_write_queue  # not before the last layer
        a.forward(layers=[stack.kv_pool.layer_num - 1])
        cp_layer_backup.notify_forward_end(stack.kv_pool)
        assert _acked(cache) == ([reserved.node_id] if per_layer else [])
        a.release()
        leaf = cache.root_node.children[nsa_stack.radix_key(_tokens(1, 3)).child_key(PS)]
        assert cache.pending_backups[leaf.id].write is reserved and not leaf.backuped
        assert _acked(cache) == ([reserved.node_id] if per_layer else [leaf.id])
        hold.release()
    cache.check_hicache_events()
    assert leaf.backuped and torch.equal(leaf.host_value, reserved.logical_host_locs)
    assert not cache.forward_reservations.rids() and cache.pending_stats.rolled_back == 0
    assert _locks_clear(cache) and not cache.ongoing_write_through
    _loads_back_exact(stack, _tokens(1, 3))


def test_per_layer_ack_before_the_insert_commits_at_the_claim(stack, scheduler_args):
    """Overlap scheduling: the next round's writing_check pops the ack of a batch whose
    results (inserts) are processed later. The claim then commits at once, unlocked."""
    cache = stack.cache
    a = Scheduled(stack, "a", _tokens(1, 3) + [7])
    assert cache.reserve_for_extend(a.req)
    reserved = cache.forward_reservations.get("a").write
    a.forward()
    cache.check_hicache_events()  # the ack pops: nothing claimed it yet
    assert not cache.cache_controller.ack_write_queue and cache.pending_stats.committed == 0
    a.release()
    leaf = cache.root_node.children[nsa_stack.radix_key(_tokens(1, 3)).child_key(PS)]
    assert leaf.backuped and torch.equal(leaf.host_value, reserved.logical_host_locs)
    assert cache.pending_stats.committed == 1 and leaf.id not in cache.pending_backups
    assert _locks_clear(cache) and not cache.ongoing_write_through
    _loads_back_exact(stack, _tokens(1, 3))


def test_insert_miss_and_retraction_roll_the_reservation_back(stack, scheduler_args, per_layer):
    cache = stack.cache
    start = _host_free(stack)
    tokens = _tokens(1, 2) + [7]
    # bs 2: both requests matched before either inserted the same new pages.
    a, b = Scheduled(stack, "a", tokens), Scheduled(stack, "b", tokens)
    assert cache.reserve_for_extend(a.req) and cache.reserve_for_extend(b.req)
    with device_module().hold_events() as hold:
        a.release()  # one forward for the batch
        b.release()  # finds a's leaf: its reservation is not claimed
        # A per-layer transfer may still be writing the pages: rolled back at its ack.
        assert cache.pending_stats.rolled_back == (0 if per_layer else 1)
        hold.release()
    cache.check_hicache_events()
    leaf = cache.root_node.children[nsa_stack.radix_key(tokens).child_key(PS)]
    assert leaf.backuped and cache.pending_stats.rolled_back == 1
    cache.evict(EvictParams(num_tokens=10**6))
    cache.evict_host(10**6)
    assert _host_free(stack) == start
    c = Scheduled(stack, "c", _tokens(5000, 2) + [7])
    assert cache.reserve_for_extend(c.req)
    c.release(is_insert=False)  # retracted (or aborted) after its forward
    cache.check_hicache_events()
    assert _host_free(stack) == start and cache.pending_stats.rolled_back == 2
    assert not cache.forward_reservations.rids() and _locks_clear(cache)
    assert not cache.ongoing_write_through and not cache.forward_reservations.tickets_in_flight()


def test_flush_with_per_layer_reservations_in_flight_frees_everything(stack, scheduler_args):
    cache = stack.cache
    start = _host_free(stack)
    a = Scheduled(stack, "a", _tokens(1, 2) + [7])
    assert cache.reserve_for_extend(a.req)
    assert len(cache.ongoing_write_through) == 1  # the scheduler is not idle: no flush yet
    a.release()
    cache.check_hicache_events()
    cache.evict(EvictParams(num_tokens=10**6))
    cache.reset()
    assert _host_free(stack) == start and not cache.forward_reservations.tickets_in_flight()


def test_reservation_probes_the_final_insertion_prefix(stack, scheduler_args):
    cache = stack.cache
    shared = _tokens(1, 2)
    b = Scheduled(stack, "b", shared + _tokens(9000, 2) + [7])  # matched nothing
    a = Scheduled(stack, "a", shared + [7])
    a.release()  # a inserts the shared pages after b's match, before b's forward
    cache.check_hicache_events()
    assert b.req.cache_protected_len == 0
    assert cache.reserve_for_extend(b.req)
    reserved = cache.forward_reservations.get("b")
    assert len(reserved.write.logical_host_locs) == 2 * PS  # only the pages b's insert adds
    b.release()
    cache.check_hicache_events()
    assert cache.pending_stats.rolled_back == 0 and cache.pending_stats.committed == 2
    assert _locks_clear(cache)


def test_prepare_for_extend_hook_reserves_for_every_request_of_the_batch(stack, scheduler_args):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sglang_cp_hicache.v0_5_12.managers.schedule_batch import prepare_for_extend_after

    cache = stack.cache
    scheduled = [Scheduled(stack, rid, _tokens(1000 * (i + 1), 2) + [7]) for i, rid in enumerate("ab")]
    batch = ScheduleBatch(reqs=[s.req for s in scheduled], tree_cache=cache)
    assert prepare_for_extend_after(None, batch) is None
    assert sorted(cache.forward_reservations.rids()) == ["a", "b"]
    for s in scheduled:
        s.release()
    cache.check_hicache_events()
    assert cache.pending_stats.committed == 2 and not cache.forward_reservations.rids()
