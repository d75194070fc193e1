"""Per-layer D2H backup of the packed MTP draft on SGLang 0.5.23's REAL sharded stack (gloo cp 2).

Each rank builds the real stack with the EAGLE MTP draft (``StackConfig(mtp_draft=True)``:
the draft's own sharded device pool, packed by upstream as the host pools' tail layer in
the target's host slots) and the plugin's hooks applied, and runs one PD-prefill step: host
slots reserved, the target forward layer by layer, then the draft forward's one layer (its
store hook reports it to the pipeline's draft stage), the insert and ``writing_check``.
Target and draft KV are different seeded draws, so a host tail holding the target's last
layer, or the draft's bytes copied before the draft stored them, reads as a mismatch. The
same step with the flag off is upstream's all-layer path (its bytes are checked too).
Every test runs on both host layouts, ``layer_first`` and ``page_first``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LAYERS = 2
SEED = 20261203
_A = list(range(1, 5 * PAGE + 1))
_C = list(range(20_001, 20_001 + PAGE))  # one page at rotation base 1: rank 0 owns none
REQUESTS: Tuple[List[int], ...] = (_A, _C)
SKIPS = ("draft_forward_without_its_layer", "target_forward_before_the_draft")
LAYOUTS = ("layer_first", "page_first")


def _stack(ctx: RankContext, cp_shared_kv: bool, layout: str):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    config = StackConfig(layer_num=LAYERS, cp_shared_kv=cp_shared_kv, mtp_draft=True, mem_layout=layout)
    return sharded_stack(ctx, config)


def _kv(stack, tokens):
    """(target KV, draft KV) of one request: independent draws."""
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import logical_kv
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_logical_kv

    return (
        logical_kv(stack, len(tokens), LAYERS, SEED + tokens[0]),
        draft_logical_kv(stack, len(tokens), SEED + 7 + tokens[0]),
    )


def _host_problems(stack, locs, host_locs, kv) -> Dict[str, List[str]]:
    """Owned host rows of the target layers and of the draft's tail layer vs their KV."""
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import host_layer_mismatches

    target_kv, draft_kv = kv
    target = []
    for layer in range(LAYERS):
        target += host_layer_mismatches(stack, host_locs, layer, target_kv, layer)
    draft = host_layer_mismatches(stack, host_locs, LAYERS, draft_kv, 0)
    return {"target": target, "draft": draft}


def _node_of(stack, tokens):
    return stack.cache.tree_core.node_by_id(stack.match(tokens).last_device_node)


def _host_value(node) -> torch.Tensor:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return node.component_data[ComponentType.FULL].host_value


def one_step(ctx: RankContext, cp_shared_kv: bool, layout: str) -> Dict[str, object]:
    """Reserve -> target forward -> draft forward -> insert -> ack -> evict -> load back."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import store_layer
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_forward
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import owned_row_mismatches
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of, notify_forward_end

    report: Dict[str, object] = {}
    with _stack(ctx, cp_shared_kv, layout) as stack:
        backup = layer_backup_of(stack.cache)
        report["pipeline_draft_layers"] = None if backup is None else backup.pipeline.draft_layer_num
        report["host_layers"] = (stack.kv_host_pool.layer_num, stack.indexer_host_pool.layer_num)
        start = (stack.device_available(), stack.host_available())
        empty = torch.empty((0,), dtype=torch.int64)
        plan = []
        for index, tokens in enumerate(REQUESTS):
            locs, base = stack.alloc_extend(empty, len(tokens), rotation_base=index)
            if backup is not None:
                backup.reserve(f"r{index}", locs, base)
            plan.append((f"r{index}", tokens, locs, base, _kv(stack, tokens)))
        queue = stack.controller.ack_write_queue
        before = len(queue)
        for layer in range(LAYERS):
            store_layer(stack, layer, [(p[2], p[4][0]) for p in plan])
        notify_forward_end(stack.kv_pool)
        report["acks_after_target_forward"] = len(queue) - before

        def reserved(rid, locs, kv):
            held = backup.reservations.get(rid) if backup is not None else None
            return None if held is None else _host_problems(stack, locs, held.write.host_indices, kv)

        report["host_before_draft"] = [reserved(rid, locs, kv) for rid, _, locs, _, kv in plan]
        draft_forward(stack, [(p[2], p[4][1]) for p in plan])
        report["acks_after_draft_layer"] = len(queue) - before
        report["ack_ids"] = [list(ack.node_ids) for ack in queue[before:]]
        report["owned_pages"] = [int(stack.owned_mask(p[2][::PAGE]).sum()) for p in plan]
        for _, tokens, locs, base, _ in plan:
            stack.insert(tokens, locs, base)
        nodes = [_node_of(stack, p[1]) for p in plan]
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        report["committed"] = [n.backuped and n.write_through_pending_id is None for n in nodes]
        report["host_after_ack"] = [
            _host_problems(stack, p[2], _host_value(n), p[4]) for n, p in zip(nodes, plan)
        ]
        # The side that reads: evict, wipe both device pools, load back from host.
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        for pool in (stack.kv_pool, stack.draft_kv_pool):
            for layer in range(pool.layer_num):
                pool.kv_buffer[layer].zero_()
                pool.index_k_with_scale_buffer[layer].zero_()
        reloads = []
        for _, tokens, _, _, kv in plan:
            match = stack.match(tokens)
            assert match.host_hit_length == len(tokens), (ctx.rank, match.host_hit_length)
            assert stack.cache.load_back(match.best_match_node)
            stack.cache.ready_to_load_host_cache()
            stack.cache.loading_check()
            locs = stack.cache.path_device_indices(stack.match(tokens).last_device_node)
            reloads.append(
                {
                    "target": owned_row_mismatches(stack, locs, kv[0], stack.kv_pool, range(LAYERS)),
                    "draft": owned_row_mismatches(stack, locs, kv[1], stack.draft_kv_pool, range(1)),
                }
            )
        report["reload"] = reloads
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        report["free_counts"] = (start, (stack.device_available(), stack.host_available()))
        if backup is not None:
            report["skipped"] = {how: _skipped_draft(stack, how) for how in SKIPS}
    return report


def _skipped_draft(stack, how: str) -> str:
    """A step whose draft forward stores no layer, or whose next target forward starts
    before the draft's: the error message (the batch's ack can no longer come)."""
    from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import forward
    from sglang_cp_hicache.testing.v0_5_23.mtp_draft import draft_forward
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of

    first = 40_001 + 1_000 * SKIPS.index(how)
    tokens = list(range(first, first + 2 * PAGE))
    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens), 0)
    layer_backup_of(stack.cache).reserve(how, locs, base)
    target_kv, draft_kv = _kv(stack, tokens)
    try:
        forward(stack, [(locs, target_kv)])
        if how == "draft_forward_without_its_layer":
            draft_forward(stack, [(locs, draft_kv)], store=False)
        else:
            forward(stack, [(locs, target_kv)])
    except PerLayerBackupIncomplete as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def scenario(ctx: RankContext, layout: str) -> Dict[str, object]:
    return {"on": one_step(ctx, True, layout), "off": one_step(ctx, False, layout)}


@pytest.fixture(scope="module", params=LAYOUTS)
def reports(request) -> Dict[bool, List[Dict[str, object]]]:
    per_rank = run_ranks(2, scenario, request.param)
    return {on: [r["on" if on else "off"] for r in per_rank] for on in (True, False)}


def test_the_draft_is_packed_as_the_host_tail_layer_and_the_pipeline_knows_it(reports):
    for on, per_rank in reports.items():
        for report in per_rank:
            assert report["host_layers"] == (LAYERS + 1, LAYERS + 1)
            assert report["pipeline_draft_layers"] == (1 if on else None)


def test_the_draft_copy_waits_for_the_draft_layer_and_the_one_ack_follows_it(reports):
    for rank, report in enumerate(reports[True]):
        assert report["acks_after_target_forward"] == 0, f"rank {rank}: acked before the draft layer"
        for request, problems in enumerate(report["host_before_draft"]):
            assert problems["target"] == [], f"rank {rank} request {request}: target layers not on host"
            owned = report["owned_pages"][request]
            # Before the draft stored its layer its host tail cannot hold the draft's bytes.
            assert bool(problems["draft"]) == bool(owned), f"rank {rank} request {request}"
        assert report["acks_after_draft_layer"] == 1, f"rank {rank}"
        assert report["ack_ids"] == reports[True][0]["ack_ids"], f"rank {rank}: ack queues differ"
    assert sorted(r["owned_pages"][1] for r in reports[True]) == [0, 1]  # C: one rank owns none


def test_each_ranks_owned_host_rows_hold_the_target_and_the_draft_bytes(reports):
    for on, per_rank in reports.items():
        for rank, report in enumerate(per_rank):
            assert report["committed"] == [True, True], f"flag {on}, rank {rank}"
            for request, problems in enumerate(report["host_after_ack"]):
                assert problems == {"target": [], "draft": []}, f"flag {on}, rank {rank}, request {request}"


def test_a_load_back_restores_the_draft_pool_byte_exact(reports):
    for on, per_rank in reports.items():
        for rank, report in enumerate(per_rank):
            for request, problems in enumerate(report["reload"]):
                assert problems == {"target": [], "draft": []}, f"flag {on}, rank {rank}, request {request}"


def test_free_counts_return(reports):
    for on, per_rank in reports.items():
        for rank, report in enumerate(per_rank):
            start, end = report["free_counts"]
            assert end == start, f"flag {on}, rank {rank}: (device, host) free {end} != {start}"


@pytest.mark.parametrize("how", SKIPS)
def test_a_step_that_skips_the_draft_layer_fails_fast(reports, how):
    for rank, report in enumerate(reports[True]):
        message = report["skipped"][how]
        assert message.startswith("PerLayerBackupIncomplete") and f"CP rank {rank}" in message, message
        assert "not the draft's" in message, message
