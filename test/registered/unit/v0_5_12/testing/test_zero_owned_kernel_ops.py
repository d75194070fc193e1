"""Zero-owned CP ranks never hand the real kernel launcher an empty transfer.

A CP rank that owns none of a write's or a load's pages has nothing to move; with the kernel
io backend an empty index tensor would reach the launcher, which divides by zero (SIGFPE).
The strict stand-in raises there instead, so these round trips on the real NSA stack (KV and
the indexer sidecar) fail if any path lets an empty op through, all-layer or per layer. The
direct backend loops over zero pages harmlessly, so it proves nothing here. CP HiCache
refuses kernel + page_first at startup (no per-layer D2H op), so layer_first is the
kernel layout to cover.
"""

import pytest
import torch

from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
RANK = 0


@pytest.fixture
def kernel_stack(gloo_world1):
    """Rank 0 of a CP-2 stack on the kernel io backend."""
    cfg = nsa_stack.StackConfig(
        cp_size=2, physical_tokens=PS * 16, io_backend="kernel", mem_layout="layer_first"
    )
    stack = nsa_stack.build_rank_stack(cfg, RANK, None, gloo_world1)
    yield stack
    stack.close()


def _write(stack, page_owners, node_id):
    """Store a node's KV and indexer bytes, back it up; return (host locs, ids, positions)."""
    logical_locs = stack.allocator.alloc_pages_with_owners(torch.tensor(page_owners))
    ids, pos = torch.arange(len(logical_locs)) + 100 * node_id, torch.arange(len(logical_locs))
    nsa_stack.write_prefill_kv(stack, logical_locs, ids, pos)
    controller = stack.cache.cache_controller
    host_locs = controller.write(logical_locs, node_id=node_id, **stack.cache._get_extra_pools())
    return host_locs, ids, pos


def _load(stack, host_locs, node_id):
    controller = stack.cache.cache_controller
    return controller.load(host_locs, node_id=node_id, **stack.cache._get_extra_pools())


def test_zero_owned_write_and_load_launch_nothing(kernel_stack):
    host_locs, _, _ = _write(kernel_stack, [1, 1], node_id=1)  # rank 0 owns neither page
    nsa_stack.wipe_device_kv(kernel_stack)
    assert len(_load(kernel_stack, host_locs, node_id=1)) == 2 * PS
    kernel_stack.cache.cache_controller.start_loading()


def test_mixed_loads_move_only_the_owned_pages_exactly(kernel_stack):
    zero_owned, _, _ = _write(kernel_stack, [1, 1], node_id=1)
    owned, ids, pos = _write(kernel_stack, [1, 0, 1, 0], node_id=2)
    nsa_stack.wipe_device_kv(kernel_stack)
    _load(kernel_stack, zero_owned, node_id=1)
    new_locs = _load(kernel_stack, owned, node_id=2)
    kernel_stack.cache.cache_controller.start_loading()
    assert nsa_stack.count_kv_mismatches(kernel_stack, new_locs, ids, pos) == 0


def test_zero_owned_per_layer_backup_launches_nothing(kernel_stack):
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun

    controller = kernel_stack.cache.cache_controller
    for node_id, owners in ((1, [1, 1]), (2, [1])):  # rank 0 owns none of these pages
        locs = kernel_stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        plan = controller.host_table.plan_write(PageRun.of(locs.numpy(), PS))
        pending = controller.reserve_write(plan, node_id, **kernel_stack.cache._get_extra_pools())
        controller.submit_write(pending, per_layer=True)
    for layer in range(controller.layer_num):
        controller.backup_layer(layer)
    assert [list(ack.node_ids) for ack in controller.ack_write_queue] == [[1, 2]]
