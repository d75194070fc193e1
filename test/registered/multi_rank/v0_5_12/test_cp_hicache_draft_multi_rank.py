"""CP HiCache with the MTP draft on N gloo ranks: target and draft KV travel together.

Each rank is a real scheduler-side cache over its own shards with the NSA draft's one-layer
pool beside the target's (as the scheduler hook hands it over). Backups (all layers at the
insert, and layer by layer during a forward with the draft's layer after it), then a device
wipe and load-back: on every rank and every hit, target *and* draft bytes are what was
written; every rank acks the same node ids in the same order, once per backup, also where it
owns nothing; no collective beyond upstream's.
"""

import hashlib

import pytest
import torch

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.testing.dist import run_ranks

PS = 64
LAYERS = 2


def _tree_digest(cache) -> str:
    digest = hashlib.sha256()
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        host_len = -1 if node.host_value is None else len(node.host_value)
        digest.update(repr((node.id, tuple(node.key.token_ids), node.evicted, host_len)).encode())
        stack.extend(sorted(node.children.values(), key=lambda n: n.id))
    return digest.hexdigest()


def _check(stack, locs, token_ids):
    """(target mismatches, draft mismatches, owned tokens) of a hit at positions 0..n-1."""
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    ids, pos = torch.tensor(token_ids[: len(locs)]), torch.arange(len(locs))
    owned = int(stack.layout.owned_mask(locs).sum()) if len(locs) else 0
    return (
        nsa_stack.count_kv_mismatches(stack, locs, ids, pos),
        nsa_stack.count_draft_kv_mismatches(stack, locs, ids, pos),
        owned,
    )


def _draft_round_trip(ctx):
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )

    from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    cfg = nsa_stack.StackConfig(
        cp_size=ctx.world_size, layer_num=LAYERS, physical_tokens=PS * 24, draft=True
    )
    stack = nsa_stack.build_rank_stack(cfg, ctx.rank, ctx.cp_group, ctx.attn_tp_group)
    cache, controller = stack.cache, stack.cache.cache_controller
    last = ctx.world_size - 1
    acks = []

    def pop_acks():
        acks.extend(list(ack.node_ids) for ack in controller.ack_write_queue)

    # 1) Write-through at the insert (all layers: target and draft in one op, one ack).
    prompts = {
        "spread": (list(range(1000, 1000 + 7 * PS)), None),
        "last_rank_only": (list(range(5000, 5000 + 3 * PS)), [last] * 3),  # others own nothing
    }
    for tokens, owners in prompts.values():
        if owners is None:
            locs = stack.allocator.alloc(len(tokens))
        else:
            locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        nsa_stack.write_prefill_kv(stack, locs, torch.tensor(tokens), torch.arange(len(tokens)))
        cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
        pop_acks()
        cache.check_hicache_events()

    # 2) Per-layer backups of one forward: target layers, the target forward's end, then the
    # draft forward's layer; the ack comes after the draft's layer only.
    per_layer = {21: [owner_of(0, p, ctx.world_size) for p in range(4)], 22: [last, last]}
    written = {}
    for node_id, owners in per_layer.items():
        locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        ids = torch.arange(len(locs)) + 1000 * node_id
        nsa_stack.write_prefill_kv(stack, locs, ids, torch.arange(len(locs)))
        plan = controller.host_table.plan_write(PageRun.of(locs.numpy(), PS))
        pending = controller.reserve_write(plan, node_id, **cache._get_extra_pools())
        controller.submit_write(pending, per_layer=True)
        written[node_id] = (pending, ids)
    for layer in range(LAYERS):
        cp_layer_backup.notify_layer_stored(stack.kv_pool, layer)
    cp_layer_backup.notify_forward_end(stack.kv_pool)
    acks_before_draft_layer = [list(ack.node_ids) for ack in controller.ack_write_queue]
    cp_layer_backup.notify_layer_stored(stack.draft_pool, 0)
    cp_layer_backup.notify_forward_end(stack.draft_pool)
    acks.extend(list(ack.node_ids) for ack in controller.ack_write_queue)
    controller.ack_write_queue.clear()

    # 3) Device gone (bytes wiped), every hit loaded back through the cache / controller.
    cache.evict(EvictParams(num_tokens=10**9))
    nsa_stack.wipe_device_kv(stack)
    hits = {}
    for name, (tokens, _) in prompts.items():
        match = cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
        loaded, _ = cache.init_load_back(
            InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
        )
        cache.ready_to_load_host_cache()
        cache.check_hicache_events()
        hits[name] = (len(loaded),) + _check(stack, loaded, tokens)
    for node_id, (pending, ids) in written.items():
        new_locs = controller.load(pending.logical_host_locs, node_id=node_id, **cache._get_extra_pools())
        controller.start_loading()
        hits[node_id] = (len(new_locs),) + _check(stack, new_locs, ids.tolist())
    usage = cache.cp_host_usage()
    result = {
        "acks": [ids for ids in acks if ids],
        "acks_before_draft_layer": acks_before_draft_layer,
        "hits": hits,
        "digest": _tree_digest(cache),
        "host_bytes": (usage["target_host_bytes"], usage["draft_host_bytes"], cache.host_budget.budget_bytes),
        "pending_loads": len(cache.ongoing_load_back),
    }
    stack.close()
    return result


@pytest.mark.parametrize("cp_size", [2, 3])
def test_target_and_draft_bytes_on_every_hit_with_identical_acks(cp_size):
    results = run_ranks(cp_size, _draft_round_trip)
    reference = results[0]
    for rank, result in enumerate(results):
        assert result["acks"] == reference["acks"], rank
        assert result["acks_before_draft_layer"] == [], rank  # the batch waits for the draft
        assert [21, 22] in result["acks"], rank
        assert result["digest"] == reference["digest"], rank
        assert result["pending_loads"] == 0, rank
        target_bytes, draft_bytes, budget = result["host_bytes"]
        assert draft_bytes > 0 and target_bytes + draft_bytes <= budget, rank
        for name, (loaded, target_bad, draft_bad, owned) in result["hits"].items():
            assert loaded > 0, (rank, name)
            assert (target_bad, draft_bad) == (0, 0), (rank, name)
    # Every hit token was checked once, by its owner; the last rank alone owns some nodes.
    for name, (loaded, *_rest) in reference["hits"].items():
        assert sum(result["hits"][name][3] for result in results) == loaded, name
    for name in ("last_rank_only", 22):
        owners = [rank for rank, result in enumerate(results) if result["hits"][name][3] > 0]
        assert owners == [cp_size - 1], name  # so the other ranks' acks were pure acks
