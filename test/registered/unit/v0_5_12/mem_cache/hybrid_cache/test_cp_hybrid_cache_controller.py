"""CpHybridCacheController: write and load plans executed on the real NSA HiCache stack.

Each test builds rank ``r`` of a CP group in this process: its decisions need no peer.
"""

import numpy as np
import pytest
import torch

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import (
    CpHiCacheMetadataError,
    JoinedHostLoadPlan,
    PageRun,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64, page_token_locs
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


@pytest.fixture
def rank_stack(gloo_world1, request):
    cp_size, cp_rank = getattr(request, "param", (2, 0))
    cfg = nsa_stack.StackConfig(cp_size=cp_size, physical_tokens=PS * 16)
    stack = nsa_stack.build_rank_stack(cfg, cp_rank, None, gloo_world1)
    yield stack
    stack.close()


class TransferSpy:
    """Records the physical indices the host pool group is asked to move (and moves them)."""

    def __init__(self, monkeypatch, host_group):
        self.backups, self.loads = [], []
        real_backup = host_group.backup_from_device_all_layer
        real_load = host_group.load_to_device_per_layer

        def backup(device_pool, host_indices, device_indices, io_backend, pool_transfers=None):
            self.backups.append((host_indices.clone(), device_indices.clone(), pool_transfers))
            return real_backup(device_pool, host_indices, device_indices, io_backend, pool_transfers)

        def load(device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers=None):
            self.loads.append((host_indices.clone(), device_indices.clone(), pool_transfers))
            return real_load(device_pool, host_indices, device_indices, layer_id, io_backend, pool_transfers)

        monkeypatch.setattr(host_group, "backup_from_device_all_layer", backup)
        monkeypatch.setattr(host_group, "load_to_device_per_layer", load)


def _sorted(t):
    return torch.sort(t.to(torch.int64)).values


def _write_node(stack, page_owners, node_id=5):
    logical_locs = stack.allocator.alloc_pages_with_owners(torch.tensor(page_owners))
    ids = torch.arange(len(logical_locs)) + 1000
    pos = torch.arange(len(logical_locs))
    nsa_stack.write_prefill_kv(stack, logical_locs, ids, pos)
    controller = stack.cache.cache_controller
    host_locs = controller.write(logical_locs, node_id=node_id, **stack.cache._get_extra_pools())
    return logical_locs, host_locs, ids, pos


def test_write_allocates_host_slots_for_owned_pages_only(rank_stack, monkeypatch):
    host = rank_stack.cache.token_to_kv_pool_host
    spy = TransferSpy(monkeypatch, host)
    free_before = host.available_size()
    logical_locs, host_locs, _, _ = _write_node(rank_stack, [0, 1, 1, 0, 1])
    assert len(host_locs) == len(logical_locs)  # logical host locs for the radix tree
    assert free_before - host.available_size() == 2 * PS
    assert rank_stack.cache.cache_controller.host_usage()["physical_slots"] == 2 * PS


def test_write_transfers_layout_physical_device_indices_kv_and_indexer(rank_stack, monkeypatch):
    spy = TransferSpy(monkeypatch, rank_stack.cache.token_to_kv_pool_host)
    logical_locs, _, _, _ = _write_node(rank_stack, [0, 1, 1, 0, 1])
    layout = rank_stack.layout
    owned = logical_locs[layout.owned_mask(logical_locs)]
    (host_idx, device_idx, transfers), = spy.backups
    assert torch.equal(_sorted(device_idx), _sorted(layout.logical_locs_to_physical(owned)))
    (indexer,) = transfers  # the NSA indexer sidecar travels with the same physical indices
    assert torch.equal(indexer.device_indices, device_idx)
    assert torch.equal(indexer.host_indices, host_idx)
    # The bytes really moved: host KV rows equal device rows at the paired slots.
    kv_host = rank_stack.cache.full_kv_pool_host
    for layer in range(rank_stack.kv_pool.layer_num):
        device_rows = rank_stack.kv_pool.kv_buffer[layer][device_idx]
        assert torch.equal(kv_host.kv_buffer[layer][host_idx].view(device_rows.shape), device_rows)


def test_zero_owned_write_returns_logical_locs_without_host_slots(rank_stack, monkeypatch):
    host = rank_stack.cache.token_to_kv_pool_host
    spy = TransferSpy(monkeypatch, host)
    free_before = host.available_size()
    logical_locs, host_locs, _, _ = _write_node(rank_stack, [1, 1, 1])  # rank 0 owns none
    assert len(host_locs) == len(logical_locs) == 3 * PS
    assert host.available_size() == free_before
    assert spy.backups == []
    meta = rank_stack.cache.cache_controller.host_table.node_metadata(host_locs, node_id=5)
    assert meta.owned_len == 0 and meta.page_owners.tolist() == [1, 1, 1]


def test_zero_owned_write_still_acks_once(rank_stack):
    controller = rank_stack.cache.cache_controller
    _write_node(rank_stack, [1, 1], node_id=21)
    _write_node(rank_stack, [0, 1], node_id=22)
    _write_node(rank_stack, [1], node_id=23)
    acks = [(ack.finish_event.query(), list(ack.node_ids)) for ack in controller.ack_write_queue]
    assert acks == [(True, [21]), (True, [22]), (True, [23])]


def test_load_allocates_full_logical_locs_with_write_time_owner_pattern(rank_stack, monkeypatch):
    owners = [0, 1, 1, 0, 1]
    _, host_locs, ids, pos = _write_node(rank_stack, owners)
    nsa_stack.wipe_device_kv(rank_stack)
    spy = TransferSpy(monkeypatch, rank_stack.cache.token_to_kv_pool_host)
    controller = rank_stack.cache.cache_controller
    new_locs = controller.load(host_locs, node_id=9, **rank_stack.cache._get_extra_pools())
    assert len(new_locs) == len(host_locs)
    assert rank_stack.layout.page_owners_of_locs(new_locs).tolist() == owners
    controller.start_loading()
    layout = rank_stack.layout
    owned_new = new_locs[layout.owned_mask(new_locs)]
    host_idx, device_idx, _ = spy.loads[0]
    assert torch.equal(_sorted(device_idx), _sorted(layout.logical_locs_to_physical(owned_new)))
    assert len(spy.loads) == rank_stack.kv_pool.layer_num
    assert nsa_stack.count_kv_mismatches(rank_stack, new_locs, ids, pos) == 0


def test_zero_owned_load_skips_transfer_returns_full_logical_locs_and_acks(rank_stack, monkeypatch):
    _, host_locs, _, _ = _write_node(rank_stack, [1, 1, 1])
    spy = TransferSpy(monkeypatch, rank_stack.cache.token_to_kv_pool_host)
    controller = rank_stack.cache.cache_controller
    producer_before = controller.layer_done_counter.producer_index
    new_locs = controller.load(host_locs, node_id=31, **rank_stack.cache._get_extra_pools())
    assert len(new_locs) == 3 * PS
    assert rank_stack.layout.page_owners_of_locs(new_locs).tolist() == [1, 1, 1]
    producer = controller.start_loading()
    assert spy.loads == []
    assert producer == (producer_before + 1) % controller.layer_done_counter.num_counters
    (ack,) = controller.ack_load_queue
    assert ack.finish_event.query() and list(ack.node_ids) == [31]


def test_mixed_loads_ack_every_node_in_one_producer(rank_stack):
    controller = rank_stack.cache.cache_controller
    _, zero_owned, _, _ = _write_node(rank_stack, [1, 1])
    _, owned, ids, pos = _write_node(rank_stack, [0, 1])
    nsa_stack.wipe_device_kv(rank_stack)
    extra = rank_stack.cache._get_extra_pools
    controller.load(zero_owned, node_id=41, **extra())
    new_locs = controller.load(owned, node_id=42, **extra())
    controller.start_loading()
    (ack,) = controller.ack_load_queue
    assert list(ack.node_ids) == [41, 42]
    # The owned node's bytes came back (its zero-owned neighbour moved nothing).
    assert nsa_stack.count_kv_mismatches(rank_stack, new_locs, ids, pos) == 0
    assert int(rank_stack.layout.owned_mask(new_locs).sum()) == PS


def test_valid_tail_load_exposes_only_valid_tokens(rank_stack):
    controller = rank_stack.cache.cache_controller
    full = rank_stack.allocator.alloc_pages_with_owners(torch.tensor([0, 1, 0]))
    valid = full[: 2 * PS + 10]  # tail page holds 10 valid tokens
    ids, pos = torch.arange(len(full)) + 7, torch.arange(len(full))
    nsa_stack.write_prefill_kv(rank_stack, full, ids, pos)
    host_locs = controller.write(valid, node_id=3, **rank_stack.cache._get_extra_pools())
    assert len(host_locs) == 2 * PS + 10
    nsa_stack.wipe_device_kv(rank_stack)
    new_locs = controller.load(host_locs, node_id=3, **rank_stack.cache._get_extra_pools())
    controller.start_loading()
    assert len(new_locs) == 2 * PS + 10
    assert torch.equal(new_locs % PS, valid % PS)
    assert nsa_stack.count_kv_mismatches(rank_stack, new_locs, ids[: len(valid)], pos[: len(valid)]) == 0
    # The padded tail page was allocated whole; freeing the valid locs returns it.
    free_before = rank_stack.allocator.available_size()
    rank_stack.allocator.free(new_locs)
    assert rank_stack.allocator.available_size() == free_before + 3 * PS


def test_host_full_write_is_refused_identically_with_lane_deficit(gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 8, hicache_ratio=1.5)
    stacks = [nsa_stack.build_rank_stack(cfg, r, None, gloo_world1) for r in range(2)]
    lane_pages = stacks[0].cache.cache_controller.host_table.physical_host_pages
    outcomes = []
    for stack in stacks:
        controller = stack.cache.cache_controller
        extra = stack.cache._get_extra_pools
        # Fill lane 0's host pages exactly (re-backing-up device pages 2, 4, ..., 16),
        # then ask for one more lane-0 page.
        remaining = lane_pages
        while remaining:
            chunk = min(remaining, 8)
            fill = page_token_locs(torch.arange(chunk) * 2 + 2, PS)
            assert controller.write(fill, node_id=1, **extra()) is not None
            remaining -= chunk
        assert controller.host_table.lane_free_pages() == [0, lane_pages]
        one_more = page_token_locs(torch.tensor([2]), PS)
        plan = controller.host_table.plan_write(PageRun.of(one_more.numpy(), PS))
        refused = controller.write(one_more, node_id=2, plan=plan, **extra())
        outcomes.append((refused is None, controller.host_table.lane_deficit(plan.lane_pages)))
        stack.close()
    assert outcomes == [(True, [1, 0]), (True, [1, 0])]


LOAD_CASES = [
    # (cp_size, cp_rank, page owners, valid tokens in the last page)
    (2, 0, [0, 0, 0], PS),  # owns everything
    (2, 0, [1, 1], PS),  # owns nothing
    (2, 0, [0, 1, 1, 0, 1], PS),
    (2, 1, [0, 1, 0], 10),  # partial tail page
    (3, 1, [2, 1, 0, 1], 33),
    (3, 2, [0, 0], 1),
    (2, 1, [1], PS),  # one page, owned: the one-page device mapping
    (3, 0, [1, 0, 2], 5),  # one owned page among others
]


@pytest.mark.parametrize("cp_size,cp_rank,owners,tail", LOAD_CASES)
def test_load_queues_owned_pages_and_returns_valid_locs_at_their_offsets(
    gloo_world1, cp_size, cp_rank, owners, tail
):
    cfg = nsa_stack.StackConfig(cp_size=cp_size, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, cp_rank, None, gloo_world1)
    controller = stack.cache.cache_controller
    extra = stack.cache._get_extra_pools
    full = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
    host_locs = controller.write(full[: len(full) - PS + tail], node_id=7, **extra())
    metadata = controller.host_table.node_metadata(host_locs, 7)

    new_locs = controller.load(host_locs, node_id=8, **extra())
    (op,) = controller.load_queue
    # Reference, loc by loc: the k-th distinct host page maps onto the k-th new page.
    host_pages, page_index = torch.unique_consecutive(host_locs // PS, return_inverse=True)
    new_pages = new_locs[::PS] // PS  # every page of the node starts at a multiple of PS
    assert len(new_pages) == len(host_pages)
    assert torch.equal(new_locs, new_pages[page_index] * PS + host_locs % PS)
    assert stack.layout.page_owners_of_locs(new_locs).tolist() == owners
    owned = metadata.page_owners == cp_rank
    owned_host_pages = metadata.host_indices[metadata.owned_positions % PS == 0] // PS
    assert torch.equal(op.host_indices, page_token_locs(owned_host_pages, PS))
    physical_pages = stack.layout.logical_pages_to_physical(new_pages[owned])
    assert torch.equal(op.device_indices, page_token_locs(physical_pages, PS))
    assert op.node_ids == [8]
    stack.close()


@pytest.mark.parametrize("cp_size,cp_rank", [(2, 0), (3, 1)])
def test_joined_load_queues_one_op_of_each_parts_owned_pages_in_part_order(gloo_world1, cp_size, cp_rank):
    """A joined load (parts owned whole, in part, not at all, one page, a tail) takes each
    part's owner pattern again and queues one op: the parts' owned host slots and new
    physical device pages, part after part."""
    cfg = nsa_stack.StackConfig(cp_size=cp_size, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, cp_rank, None, gloo_world1)
    controller, table, layout = stack.cache.cache_controller, stack.cache.host_table, stack.layout
    other = (cp_rank + 1) % cp_size
    nodes = [([cp_rank], PS), ([cp_rank, other, cp_rank], PS), ([other], PS), ([other, cp_rank], 9)]
    host_values, metadata = [], []
    for node_id, (owners, tail) in enumerate(nodes):
        full = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        host_locs = controller.write(full[: len(full) - PS + tail], node_id=node_id, **stack.cache._get_extra_pools())
        host_values.append(host_locs)
        metadata.append(table.node_metadata(host_locs, node_id))
    plan = JoinedHostLoadPlan([table.plan_load(host_int64(locs)) for locs in host_values])

    part_locs = controller.load_planned(plan, node_id=9, **stack.cache._get_extra_pools())
    (op,) = controller.load_queue
    assert [len(locs) for locs in part_locs] == [len(locs) for locs in host_values]
    expected_host, expected_device = [], []
    for locs, host_locs, meta, (owners, _) in zip(part_locs, host_values, metadata, nodes):
        assert np.array_equal(locs % PS, host_locs.numpy() % PS)
        new_pages = locs[::PS] // PS
        assert layout.owner_for_logical_pages(new_pages).tolist() == owners
        owned_host_pages = meta.host_indices[meta.owned_positions % PS == 0] // PS
        expected_host.append(page_token_locs(owned_host_pages, PS))
        physical_pages = layout.logical_pages_to_physical(new_pages[lane_of(new_pages, cp_size) == cp_rank])
        expected_device.append(torch.from_numpy(page_token_locs(physical_pages, PS)))
    assert torch.equal(op.host_indices, torch.cat(expected_host))
    assert torch.equal(op.device_indices, torch.cat(expected_device))
    assert op.node_ids == [9]
    stack.close()


@pytest.mark.parametrize("pages", [[6], [2, 8, 4]])
def test_physical_device_locs_are_the_layouts_whole_pages(rank_stack, pages):
    """One page (mapped in Python ints) or several: the layout's physical pages, expanded."""
    logical_pages = np.array(pages, dtype=np.int64)  # owned by rank 0 at cp 2
    locs = rank_stack.cache.cache_controller._physical_device_locs(logical_pages)
    expected = page_token_locs(rank_stack.layout.logical_pages_to_physical(logical_pages), PS)
    assert locs.dtype == torch.int64 and locs.tolist() == expected.tolist()


def test_load_of_an_unallocated_host_page_names_node_and_rank(gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, 1, None, gloo_world1)
    controller = stack.cache.cache_controller
    host_locs = controller.write(stack.allocator.alloc(2 * PS), node_id=3, **stack.cache._get_extra_pools())
    controller.release_host(host_locs)
    with pytest.raises(CpHiCacheMetadataError, match="node 4 on CP rank 1"):
        controller.load(host_locs, node_id=4)
    stack.close()


def test_load_refused_for_a_short_lane_changes_nothing(rank_stack):
    controller = rank_stack.cache.cache_controller
    _, host_locs, _, _ = _write_node(rank_stack, [0, 1])
    allocator = rank_stack.allocator
    lane1 = allocator.lane_free_pages()[1]
    held = allocator.alloc_pages_with_owners(torch.ones(lane1, dtype=torch.int64))
    state = allocator.backup_state()
    assert controller.load(host_locs, node_id=9, **rank_stack.cache._get_extra_pools()) is None
    assert [list(map(len, lanes)) for lanes in allocator.backup_state()] == [
        list(map(len, lanes)) for lanes in state
    ]
    assert controller.load_queue == []
    allocator.free(held)


def _reserve_node(stack, page_owners, node_id=7):
    logical_locs = stack.allocator.alloc_pages_with_owners(torch.tensor(page_owners))
    nsa_stack.write_prefill_kv(
        stack, logical_locs, torch.arange(len(logical_locs)) + 2000, torch.arange(len(logical_locs))
    )
    controller = stack.cache.cache_controller
    plan = controller.host_table.plan_write(PageRun.of(logical_locs.numpy(), PS))
    return logical_locs, controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools())


def test_reserve_takes_host_pages_but_queues_no_transfer_and_no_ack(rank_stack, monkeypatch):
    host = rank_stack.cache.token_to_kv_pool_host
    spy = TransferSpy(monkeypatch, host)
    controller = rank_stack.cache.cache_controller
    free_before = host.available_size()
    _, pending = _reserve_node(rank_stack, [0, 1, 0])
    assert free_before - host.available_size() == 2 * PS
    assert controller.host_table.lane_used_pages() == [2, 1]
    assert spy.backups == [] and controller.write_queue == [] and controller.ack_write_queue == []
    controller.submit_write(pending)
    (host_idx, _, _), = spy.backups
    assert torch.equal(_sorted(host_idx), _sorted(pending.operation.host_indices))
    assert [list(ack.node_ids) for ack in controller.ack_write_queue] == [[7]]


def test_rollback_frees_exactly_the_reservation(rank_stack):
    host = rank_stack.cache.token_to_kv_pool_host
    controller = rank_stack.cache.cache_controller
    _, kept = _reserve_node(rank_stack, [0, 1], node_id=8)
    free_before, lanes_before = host.available_size(), controller.host_table.lane_used_pages()
    _, pending = _reserve_node(rank_stack, [0, 0, 1], node_id=9)
    controller.rollback_write(pending)
    assert host.available_size() == free_before
    assert controller.host_table.lane_used_pages() == lanes_before
    assert controller.host_table.node_metadata(kept.logical_host_locs, 8).owned_len == PS
    with pytest.raises(CpHiCacheMetadataError, match="node 9 on CP rank 0"):
        controller.rollback_write(pending)  # freed twice


def test_zero_owned_reservation_acks_once_on_submit(rank_stack):
    controller = rank_stack.cache.cache_controller
    _, pending = _reserve_node(rank_stack, [1, 1], node_id=31)
    assert pending.operation is None and controller.ack_write_queue == []
    controller.submit_write(pending)
    assert [list(ack.node_ids) for ack in controller.ack_write_queue] == [[31]]
