"""Per-layer CP HiCache backups on N gloo ranks, then load-back: bytes per layer, acks agree.

Each rank backs up only its owned pages, one layer per ``backup_layer`` call (as the NSA
extend hook drives it), alongside an all-layer backup and a node some ranks own nothing
of. Every rank must ack the same node ids in the same order, only after the last layer;
after a device wipe, every loaded page holds what was written, layer by layer.
"""

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

PS = 64
LAYERS = 3


def _per_layer_round_trip(ctx, io_backend, layout):
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    cfg = nsa_stack.StackConfig(
        cp_size=ctx.world_size, layer_num=LAYERS, physical_tokens=PS * 24,
        io_backend=io_backend, mem_layout=layout,
    )
    stack = nsa_stack.build_rank_stack(cfg, ctx.rank, ctx.cp_group, ctx.attn_tp_group)
    controller = stack.cache.cache_controller
    extra = stack.cache._get_extra_pools  # fresh per call: the controller fills its transfers in
    last = ctx.world_size - 1
    nodes = {  # node id -> page owners (identical on every rank)
        11: [p % ctx.world_size for p in range(5)],
        12: [last, last],  # every other rank owns nothing of it
        13: [0, last, 0],  # backed up all layers at once, mid-forward
    }
    written = {}
    for node_id, owners in nodes.items():
        locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        ids = torch.arange(len(locs)) + 1000 * node_id
        nsa_stack.write_prefill_kv(stack, locs, ids, torch.arange(len(locs)))
        plan = controller.host_table.plan_write(PageRun.of(locs.numpy(), PS))
        written[node_id] = (controller.reserve_write(plan, node_id, **extra()), ids)
    controller.submit_write(written[11][0], per_layer=True)
    controller.submit_write(written[12][0], per_layer=True)
    acks_before_last = []
    for layer in range(LAYERS):
        if layer == 1:
            controller.submit_write(written[13][0])
        if layer == LAYERS - 1:
            acks_before_last = [list(ack.node_ids) for ack in controller.ack_write_queue]
        controller.backup_layer(layer)
    acks = [list(ack.node_ids) for ack in controller.ack_write_queue]
    controller.ack_write_queue.clear()

    nsa_stack.wipe_device_kv(stack)
    loaded_mismatches = {}
    for node_id, (pending, ids) in written.items():
        new_locs = controller.load(pending.logical_host_locs, node_id=node_id, **extra())
        controller.start_loading()
        loaded_mismatches[node_id] = nsa_stack.kv_mismatches_per_layer(
            stack, new_locs, ids, torch.arange(len(new_locs))
        )
        owned = int(stack.layout.owned_mask(new_locs).sum()) if len(new_locs) else 0
        loaded_mismatches[node_id].append(owned)
    stack.close()
    return {"acks_before_last": acks_before_last, "acks": acks, "loaded": loaded_mismatches}


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("io_backend,layout", [("direct", "layer_first"), ("kernel", "layer_first"), ("direct", "page_first_direct")])
def test_per_layer_backups_load_back_byte_exact_with_identical_acks(cp_size, io_backend, layout):
    results = run_ranks(cp_size, _per_layer_round_trip, io_backend, layout)
    for rank, result in enumerate(results):
        assert result["acks_before_last"] == [[13]], rank
        assert result["acks"] == [[13], [11, 12]], rank
        for node_id, per_layer in result["loaded"].items():
            *mismatches, owned_tokens = per_layer
            assert mismatches == [0] * LAYERS, (rank, node_id)
        assert result["loaded"][11][-1] > 0  # every rank owns pages of node 11
    owners_of_12 = [r for r, res in enumerate(results) if res["loaded"][12][-1] > 0]
    assert owners_of_12 == [cp_size - 1]  # so the other ranks' ack of 12 was a pure ack
