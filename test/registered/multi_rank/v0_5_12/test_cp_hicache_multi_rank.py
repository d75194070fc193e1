"""CP HiCache on N gloo ranks: each rank a real scheduler-side cache over its own shards.

Every scenario checks bytes (MLA KV and indexer K/scale) on every rank and that ranks made
identical decisions (same tree, same ack ids) without any collective beyond upstream's.
"""

import hashlib

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

PS = 64


def _stack(ctx, **overrides):
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    cfg = dict(cp_size=ctx.world_size, physical_tokens=PS * 16)
    cfg.update(overrides)
    return nsa_stack.build_rank_stack(
        nsa_stack.StackConfig(**cfg), ctx.rank, ctx.cp_group, ctx.attn_tp_group
    )


def _tree_digest(cache) -> str:
    """Structure, node ids, residency and logical host lengths: identical on all ranks."""
    digest = hashlib.sha256()
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        host_len = -1 if node.host_value is None else len(node.host_value)
        digest.update(repr((node.id, tuple(node.key.token_ids), node.evicted, host_len)).encode())
        stack.extend(sorted(node.children.values(), key=lambda n: n.id))
    return digest.hexdigest()


class Driver:
    """Scheduler-like calls on one rank: prefill (alloc, write owned KV, insert), load back."""

    def __init__(self, stack):
        from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

        self.stack, self.ns = stack, nsa_stack
        self.written = {}

    def prefill(self, tokens, locs=None):
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        locs = self.stack.allocator.alloc(len(tokens)) if locs is None else locs
        ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
        self.ns.write_prefill_kv(self.stack, locs, ids, pos)
        self.stack.cache.insert(InsertParams(key=self.ns.radix_key(tokens), value=locs))
        self.stack.cache.check_hicache_events()
        return locs

    def evict_all_device(self):
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        self.stack.cache.evict(EvictParams(num_tokens=10**9))
        self.ns.wipe_device_kv(self.stack)  # only a real load-back can restore bytes

    def load_back(self, tokens):
        from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams, MatchPrefixParams

        cache = self.stack.cache
        match = cache.match_prefix(MatchPrefixParams(key=self.ns.radix_key(tokens)))
        loaded, _ = cache.init_load_back(
            InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
        )
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()
        prefix = torch.cat([match.device_indices, loaded]) if len(loaded) else match.device_indices
        n = len(prefix)
        mismatches = self.ns.count_kv_mismatches(
            self.stack, prefix, torch.tensor(tokens[:n]), torch.arange(n)
        )
        return {"host_hit": match.host_hit_length, "loaded": len(loaded), "mismatches": mismatches}


# ------------------------------------------------------------------ scenarios
def _round_trip(ctx):
    stack = _stack(ctx)
    drv = Driver(stack)
    tokens = list(range(1000, 1000 + 7 * PS))
    drv.prefill(tokens)
    drv.evict_all_device()
    result = drv.load_back(tokens)
    result.update(
        digest=_tree_digest(stack.cache),
        physical_host_slots=stack.cache.cp_host_usage()["physical_slots"],
        logical_host_tokens=stack.cache.cp_host_usage()["logical_tokens"],
    )
    return result


def _zero_owned_node(ctx):
    stack = _stack(ctx)
    drv = Driver(stack)
    # Pages owned only by the last rank: every other rank owns nothing in this node.
    owners = torch.full((3,), ctx.world_size - 1)
    locs = stack.allocator.alloc_pages_with_owners(owners)
    tokens = list(range(5000, 5000 + 3 * PS))
    drv.prefill(tokens, locs)
    node = stack.cache.match_prefix.__self__.root_node.children[drv.ns.radix_key(tokens).child_key(PS)]
    written = stack.cache.node_host_metadata(node).owned_len
    drv.evict_all_device()
    result = drv.load_back(tokens)
    result.update(owned=written, digest=_tree_digest(stack.cache), pending=len(stack.cache.ongoing_load_back))
    return result


def _host_full_retry(ctx):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    stack = _stack(ctx, hicache_ratio=1.25)
    drv = Driver(stack)
    table = stack.cache.cache_controller.host_table
    prompts = [list(range(i * 10000, i * 10000 + 4 * PS)) for i in range(table.physical_host_pages + 2)]
    backed = []
    for prompt in prompts:  # host pressure: older host nodes get evicted to admit new ones
        drv.prefill(prompt)
        node = stack.cache.root_node.children[drv.ns.radix_key(prompt).child_key(PS)]
        backed.append(node.backuped)
        stack.cache.evict(EvictParams(num_tokens=4 * PS))
    retried = drv.load_back(prompts[-1])
    # Clean failure: every host node is protected (host_ref_counter > 0, as an in-use
    # prefetch would hold it), so a write needing room is refused on every rank and the
    # new node simply stays without a host copy.
    drv.evict_all_device()
    protected = [n for n in stack.cache.evictable_host_leaves]
    for node in protected:
        node.protect_host()
    fresh = list(range(800000, 800000 + 4 * PS))
    while min(table.lane_free_pages()) >= 2:  # leave no lane room for `fresh`
        filler = list(range(len(backed) * 7919 + 900000, len(backed) * 7919 + 900000 + 4 * PS))
        backed.append(True)
        drv.prefill(filler)
        stack.cache.evict(EvictParams(num_tokens=4 * PS))
        for node in stack.cache.evictable_host_leaves:
            if node.host_ref_counter == 0:
                node.protect_host()
                protected.append(node)
    host_free = stack.cache.token_to_kv_pool_host.available_size()
    drv.prefill(fresh)
    refused = stack.cache.root_node.children[drv.ns.radix_key(fresh).child_key(PS)]
    for node in protected:
        node.release_host()
    return {
        "all_backed": all(backed),
        "retry": retried,
        "refused_backed": refused.backuped,
        "host_free_unchanged": stack.cache.token_to_kv_pool_host.available_size() == host_free,
        "digest": _tree_digest(stack.cache),
    }


def _split_then_load_each_half(ctx):
    stack = _stack(ctx)
    drv = Driver(stack)
    tokens = list(range(2000, 2000 + 6 * PS))
    drv.prefill(tokens)
    drv.evict_all_device()
    branch = tokens[: 2 * PS] + list(range(70000, 70000 + 2 * PS))
    drv.prefill(branch)  # splits the evicted node at 2 pages; first half revived on device
    drv.evict_all_device()
    first = drv.load_back(tokens[: 2 * PS])
    drv.evict_all_device()
    whole = drv.load_back(tokens)
    return {"first": first, "whole": whole, "digest": _tree_digest(stack.cache)}


def _lane_exhaustion_recovered(ctx):
    stack = _stack(ctx)
    drv = Driver(stack)
    allocator = stack.allocator
    target = list(range(3000, 3000 + 4 * PS))
    drv.prefill(target)
    drv.evict_all_device()
    # Least recently used: cache on the *other* lane. A scalar retry (evict
    # len(host_indices) tokens) would free exactly this and still could not load.
    old_tokens = list(range(300000, 300000 + 4 * PS))
    drv.prefill(old_tokens, allocator.alloc_pages_with_owners(torch.ones(4, dtype=torch.int64)))
    # Then lane 0 full of evictable cache; other lanes roomy but mostly in use, so only
    # evicting lane-0 cache can make the load fit.
    lane0_free = int(allocator.lane_available_pages()[0])
    hog = allocator.alloc_pages_with_owners(torch.zeros(lane0_free, dtype=torch.int64))
    hog_tokens = list(range(400000, 400000 + len(hog)))
    drv.prefill(hog_tokens, hog)
    spare = 2  # the target has 2 pages on each lane
    others = torch.arange(1, ctx.world_size).repeat_interleave(
        (allocator.lane_available_pages()[1:] - spare).clamp(min=0)
    )
    busy = allocator.alloc_pages_with_owners(others) if len(others) else None
    before = allocator.lane_available_pages().tolist()
    result = drv.load_back(target)
    children = stack.cache.root_node.children
    result.update(
        lane0_before=before[0],
        old_evicted=children[drv.ns.radix_key(old_tokens).child_key(PS)].evicted,
        hog_evicted=children[drv.ns.radix_key(hog_tokens).child_key(PS)].evicted,
        digest=_tree_digest(stack.cache),
    )
    if busy is not None:
        allocator.free(busy)
    return result


def _pending_backups_defer_and_commit(ctx):
    """A's backup in flight (events held on every rank), B would split it, C is a chunked
    prompt; after the acks: B splits, everything comes back from host with its bytes."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_cp_hicache.testing import device_module

    stack = _stack(ctx)
    drv, cache = Driver(stack), stack.cache
    tokens_a = list(range(1000, 1000 + 4 * PS))
    tokens_c = list(range(60000, 60000 + 4 * PS))
    req_b = Req(
        rid="b", origin_input_text="", sampling_params=SamplingParams(),
        origin_input_ids=tokens_a[: 2 * PS] + list(range(90000, 90000 + PS)) + [1],
    )  # fmt: skip
    locs_c = stack.allocator.alloc(len(tokens_c))
    drv.ns.write_prefill_kv(stack, locs_c, torch.tensor(tokens_c), torch.arange(len(tokens_c)))
    with device_module().hold_events() as hold:
        locs_a = stack.allocator.alloc(len(tokens_a))
        drv.ns.write_prefill_kv(stack, locs_a, torch.tensor(tokens_a), torch.arange(len(tokens_a)))
        node_a = drv.ns.insert_at_root(stack, tokens_a, locs_a)
        cache.inc_lock_ref(node_a)  # A keeps running on its node
        for end in (2 * PS, 4 * PS):  # C's chunks, pending too
            cache.insert(InsertParams(key=drv.ns.radix_key(tokens_c[:end]), value=locs_c[:end].clone(), chunked=True))
        cache.check_hicache_events()  # the one all-reduce: nothing finished on any rank
        pending = sorted(cache.pending_backups)
        req_b.init_next_round_input(cache)
        deferred = (cache.take_split_deferral(req_b), len(req_b.prefix_indices), len(node_a.key))
        hold.release()
    cache.check_hicache_events()
    req_b.init_next_round_input(cache)
    after = (cache.take_split_deferral(req_b), len(req_b.prefix_indices))
    cache.dec_lock_ref(node_a)
    drv.evict_all_device()
    return {
        "pending": pending,
        "deferred": deferred,
        "after": after,
        "stats": (cache.pending_stats.committed, cache.pending_stats.deferred_splits),
        "a": drv.load_back(tokens_a),
        "c": drv.load_back(tokens_c),
        "protected": cache.protected_size_,
        "digest": _tree_digest(cache),
    }


def _per_layer_forward_reservations(ctx):
    """One prefill batch through SGLang's alloc_for_extend and the plugin's
    prepare_for_extend hook: A (4 pages), B (1 page: owned by one rank only) and A2 (A's
    tokens: its insert misses). Their backups move during the forward, layer by layer, as
    one transfer per layer; one ack after the last layer carries every reservation. Then
    the inserts claim A and B, A2's reservation is rolled back at the ack, and both come
    back from host with their bytes."""
    import sglang.srt.plugins as sglang_plugins

    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch

    if not sglang_plugins._plugins_loaded:
        sglang_plugins.load_plugins()  # the alloc_for_extend hook keeps the host mirror
    with scheduler_batch.cpu_scheduler_server_args(PS):  # what a scheduler process has
        return _per_layer_batch(ctx)


def _per_layer_batch(ctx):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.sampling.sampling_params import SamplingParams

    from sglang_cp_hicache.v0_5_12.managers.schedule_batch import prepare_for_extend_after
    from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
    from sglang_cp_hicache.testing import device_module
    from sglang_cp_hicache.testing.v0_5_12 import scheduler_batch

    stack = _stack(ctx)
    drv, cache, pool = Driver(stack), stack.cache, stack.kv_pool
    host_start = cache.token_to_kv_pool_host.available_size()
    prompts = {
        "a": list(range(1000, 1000 + 4 * PS)) + [1],
        "b": list(range(7000, 7000 + PS)) + [1],
        "a2": list(range(1000, 1000 + 4 * PS)) + [1],
    }
    reqs = [
        Req(rid=rid, origin_input_text="", origin_input_ids=ids, sampling_params=SamplingParams())
        for rid, ids in prompts.items()
    ]
    for req in reqs:
        req.init_next_round_input(cache)
        cache.inc_lock_ref(req.last_node)
    batch = scheduler_batch.extend_batch(stack, reqs, [len(r.fill_ids) for r in reqs])
    for req in reqs:
        req.kv_committed_len = len(req.fill_ids)  # what the forward commits
    prepare_for_extend_after(None, batch)
    tickets = sorted(cache.forward_reservations.tickets_in_flight())
    controller = cache.cache_controller
    held = list(controller.held_write_node_ids)
    offset = 0
    with device_module().hold_events() as hold:
        for req in reqs:
            n = len(req.fill_ids)
            ids, pos = torch.tensor(req.fill_ids), torch.arange(n)
            drv.ns.write_prefill_kv(stack, batch.out_cache_loc[offset : offset + n], ids, pos)
            offset += n
        for layer in range(pool.start_layer, pool.start_layer + pool.layer_num):
            cp_layer_backup.notify_layer_stored(pool, layer)
        cp_layer_backup.notify_forward_end(pool)
        acks = [list(ack.node_ids) for ack in controller.ack_write_queue]
        for req in reqs:
            cache.cache_finished_req(req)
        cache.check_hicache_events()  # the one all-reduce: nothing landed on any rank
        in_flight = (len(cache.pending_backups), cache.pending_stats.rolled_back)
        hold.release()
    cache.check_hicache_events()
    stats = (cache.pending_stats.committed, cache.pending_stats.rolled_back)
    result = {
        "tickets": tickets,
        "held": held,
        "acks": acks,
        "in_flight": in_flight,
        "stats": stats,
        "protected": cache.protected_size_,
        "a": None,
        "b": None,
    }
    drv.evict_all_device()
    result["a"] = drv.load_back(prompts["a"][: 4 * PS])
    result["b"] = drv.load_back(prompts["b"][:PS])
    result["digest"] = _tree_digest(cache)
    cache.evict(EvictParams(num_tokens=10**9))
    cache.evict_host(10**9)
    result["host_free_restored"] = cache.token_to_kv_pool_host.available_size() == host_start
    result["layer_num"] = pool.layer_num
    return result


# --------------------------------------------------------------------- tests
@pytest.mark.parametrize("cp_size", [2, 3, 4])
def test_write_evict_load_back_bytes_on_every_rank(cp_size):
    results = run_ranks(cp_size, _round_trip)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["host_hit"] == 7 * PS and r["loaded"] == 7 * PS and r["mismatches"] == 0
        assert r["logical_host_tokens"] == 7 * PS
    # Each rank holds only its shard; together exactly the logical pages.
    assert sum(r["physical_host_slots"] for r in results) == 7 * PS
    assert max(r["physical_host_slots"] for r in results) < 7 * PS


def test_rank_owning_nothing_in_a_node_still_acks():
    results = run_ranks(2, _zero_owned_node)
    assert [r["owned"] for r in results] == [0, 3 * PS]
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["host_hit"] == r["loaded"] == 3 * PS and r["mismatches"] == 0
        assert r["pending"] == 0  # the load ack arrived on the zero-owned rank too


def test_host_full_retry_succeeds_and_refusal_is_clean():
    results = run_ranks(2, _host_full_retry)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["all_backed"]  # each write admitted after evicting host victims
        assert r["retry"]["host_hit"] == 4 * PS and r["retry"]["mismatches"] == 0
        assert not r["refused_backed"] and r["host_free_unchanged"]


def test_split_backed_up_node_then_load_each_half():
    results = run_ranks(2, _split_then_load_each_half)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["first"]["loaded"] == 2 * PS and r["first"]["mismatches"] == 0
        assert r["whole"]["host_hit"] + r["whole"]["loaded"] >= 4 * PS
        assert r["whole"]["mismatches"] == 0


def test_owner_lane_exhaustion_during_load_back_recovered_by_targeted_eviction():
    results = run_ranks(2, _lane_exhaustion_recovered)
    assert len({r["digest"] for r in results}) == 1
    for r in results:
        assert r["lane0_before"] == 0
        assert r["loaded"] == 4 * PS and r["mismatches"] == 0
        # Only the short lane's cache goes: the older node frees nothing on lane 0.
        assert r["hog_evicted"] and not r["old_evicted"]


@pytest.mark.parametrize("cp_size", [2, 3])
def test_pending_backups_defer_splits_commit_on_the_ack_and_load_back_their_bytes(cp_size):
    results = run_ranks(cp_size, _pending_backups_defer_and_commit)
    assert len({repr({k: r[k] for k in ("pending", "deferred", "after", "stats", "digest")}) for r in results}) == 1
    for r in results:
        assert len(r["pending"]) == 3  # A and C's two chunks, all in flight at once
        assert r["deferred"] == (True, 0, 4 * PS)  # B waited; A's node was not split
        assert r["after"] == (False, 2 * PS)
        assert r["stats"] == (3, 1) and r["protected"] == 0
        for prompt in ("a", "c"):
            assert r[prompt]["host_hit"] == r[prompt]["loaded"] == 4 * PS
            assert r[prompt]["mismatches"] == 0


@pytest.mark.parametrize("cp_size", [2, 3])
def test_per_layer_backups_of_a_batch_move_during_its_forward_on_every_rank(cp_size):
    results = run_ranks(cp_size, _per_layer_forward_reservations)
    keys = ("tickets", "held", "acks", "in_flight", "stats", "digest")
    assert len({repr({k: r[k] for k in keys}) for r in results}) == 1
    for r in results:
        assert len(r["tickets"]) == 3 and r["held"] == sorted(r["tickets"], reverse=True)
        # One ack for the batch after its last layer, naming every reservation, on every
        # rank (B's rank-less ranks and A2's duplicate too).
        assert r["acks"] == [r["held"]]
        assert r["in_flight"] == (2, 0)  # A and B claimed, pending; A2 waits for its ack
        assert r["stats"] == (2, 1) and r["protected"] == 0
        assert r["a"]["host_hit"] == r["a"]["loaded"] == 4 * PS and r["a"]["mismatches"] == 0
        assert r["b"]["host_hit"] == r["b"]["loaded"] == PS and r["b"]["mismatches"] == 0
        assert r["host_free_restored"]
