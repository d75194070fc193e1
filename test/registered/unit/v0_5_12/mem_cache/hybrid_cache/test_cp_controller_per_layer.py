"""CpHybridCacheController per-layer backups on the real NSA HiCache stack (rank 0 of CP 2).

The forward's layer hook calls ``backup_layer(l)`` once per layer; every held backup of the
batch moves layer ``l`` in one transfer, and the batch acks once, after the last layer.
"""

from collections import Counter

import pytest
import torch

from sglang.srt.mem_cache.hicache_storage import PoolName

from sglang_cp_hicache.core.per_layer_backup import PerLayerBackupIncomplete
from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import CpHiCacheMetadataError, PageRun
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64
LAYERS = 3


@pytest.fixture(params=[("direct", "layer_first"), ("kernel", "layer_first"), ("direct", "page_first_direct")])
def stack(gloo_world1, request):
    io_backend, layout = request.param
    cfg = nsa_stack.StackConfig(
        cp_size=2, layer_num=LAYERS, physical_tokens=PS * 16, io_backend=io_backend, mem_layout=layout
    )
    built = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    yield built
    built.close()


class LayerSpy:
    """Records each per-layer transfer of one host pool (and performs it)."""

    def __init__(self, monkeypatch, pool_backup):
        self.calls = []
        real = pool_backup.backup_from_device_per_layer

        def backup(device_pool, host_indices, device_indices, layer_id, io_backend):
            self.calls.append((layer_id, host_indices.clone(), device_indices.clone()))
            return real(device_pool, host_indices, device_indices, layer_id, io_backend)

        monkeypatch.setattr(pool_backup, "backup_from_device_per_layer", backup)

    def layers(self):
        return [layer for layer, _, _ in self.calls]


def _spies(monkeypatch, controller):
    backups = controller.layer_backup.entry_backups
    return LayerSpy(monkeypatch, backups[PoolName.KV]), LayerSpy(monkeypatch, backups[PoolName.INDEXER])


def _reserve(stack, page_owners, node_id):
    logical_locs = stack.allocator.alloc_pages_with_owners(torch.tensor(page_owners))
    ids, pos = torch.arange(len(logical_locs)) + 100 * node_id, torch.arange(len(logical_locs))
    nsa_stack.write_prefill_kv(stack, logical_locs, ids, pos)
    controller = stack.cache.cache_controller
    plan = controller.host_table.plan_write(PageRun.of(logical_locs.numpy(), PS))
    return controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools())


def _pairs(host_indices, device_indices):
    """(host, device) index pairs, order-free (direct layer_first sorts by host)."""
    return sorted(zip(host_indices.tolist(), device_indices.tolist()))


def _ack_ids(controller):
    return [list(ack.node_ids) for ack in controller.ack_write_queue]


def _kv_layer(stack, layer):
    """Host KV of one layer, one row per host slot, as bytes."""
    host = stack.cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    part = host.kv_buffer[layer] if host.layout == "layer_first" else host.kv_buffer[:, layer]
    return part.reshape(-1, part.shape[-1]).view(torch.uint8)


def test_each_layer_moves_every_held_backup_once_kv_and_indexer(stack, monkeypatch):
    controller = stack.cache.cache_controller
    kv, index = _spies(monkeypatch, controller)
    held = [_reserve(stack, [0, 1, 0], 7), _reserve(stack, [1, 0], 8)]
    for pending in held:
        controller.submit_write(pending, per_layer=True)
    assert kv.calls == [] and index.calls == [] and controller.ack_write_queue == []
    expected = _pairs(
        torch.cat([p.operation.host_indices for p in held]),
        torch.cat([p.operation.device_indices for p in held]).cpu(),
    )
    for layer in range(LAYERS):
        controller.backup_layer(layer)
        assert kv.layers() == index.layers() == list(range(layer + 1))
    assert Counter(kv.layers()) == Counter(range(LAYERS))
    for (_, kv_host, kv_device), (_, ix_host, ix_device) in zip(kv.calls, index.calls):
        assert _pairs(kv_host.cpu(), kv_device.cpu()) == expected  # 3 owned pages, both nodes
        assert len(expected) == 3 * PS
        assert torch.equal(ix_host, kv_host) and torch.equal(ix_device, kv_device)


def test_host_bytes_of_a_layer_arrive_with_that_layer_only(stack):
    controller = stack.cache.cache_controller
    pending = _reserve(stack, [0, 1, 0, 0], 7)
    controller.submit_write(pending, per_layer=True)
    host_rows = pending.operation.host_indices.cpu()
    device_rows = pending.operation.device_indices.cpu()
    before = [_kv_layer(stack, layer).clone() for layer in range(LAYERS)]
    for layer in range(LAYERS):
        controller.backup_layer(layer)
        for other in range(LAYERS):
            got = _kv_layer(stack, other)
            if other <= layer:
                device = stack.kv_pool.kv_buffer[other][device_rows]
                assert torch.equal(got[host_rows], device.reshape(len(device_rows), -1).view(torch.uint8))
            else:
                assert torch.equal(got, before[other]), (layer, other)


def test_one_ack_with_all_node_ids_only_after_the_last_layer(stack):
    controller = stack.cache.cache_controller
    for node_id, owners in ((7, [0, 1]), (8, [1, 1]), (9, [0])):
        controller.submit_write(_reserve(stack, owners, node_id), per_layer=True)
    for layer in range(LAYERS - 1):
        controller.backup_layer(layer)
        assert controller.ack_write_queue == []
    assert controller.held_write_node_ids == [7, 8, 9]
    controller.backup_layer(LAYERS - 1)
    assert _ack_ids(controller) == [[7, 8, 9]]
    assert controller.held_write_node_ids == []
    controller.backup_layer(0)  # the next forward, nothing held: no-op
    assert _ack_ids(controller) == [[7, 8, 9]]


def test_zero_owned_rank_transfers_nothing_and_acks_once_at_the_last_layer(stack, monkeypatch):
    controller = stack.cache.cache_controller
    kv, index = _spies(monkeypatch, controller)
    pending = _reserve(stack, [1, 1], 31)  # rank 0 owns neither page
    assert pending.operation is None
    controller.submit_write(pending, per_layer=True)
    for layer in range(LAYERS - 1):
        controller.backup_layer(layer)
    assert controller.ack_write_queue == []
    controller.backup_layer(LAYERS - 1)
    assert _ack_ids(controller) == [[31]]
    assert kv.calls == [] and index.calls == []


def test_all_layer_backup_submitted_while_held_acks_before_the_batch(stack):
    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0, 1], 7), per_layer=True)
    controller.submit_write(_reserve(stack, [0], 9))  # e.g. a hit-count backup
    controller.submit_write(_reserve(stack, [1], 10))  # zero-owned on this rank
    assert _ack_ids(controller) == [[9], [10]]
    for layer in range(LAYERS):
        controller.backup_layer(layer)
    assert _ack_ids(controller) == [[9], [10], [7]]


def test_a_repeated_layer_notification_is_ignored(stack, monkeypatch):
    controller = stack.cache.cache_controller
    kv, _ = _spies(monkeypatch, controller)
    controller.submit_write(_reserve(stack, [0], 7), per_layer=True)
    controller.backup_layer(0)
    controller.backup_layer(0)  # chunked-prefix MHA runs the attention twice per layer
    assert kv.layers() == [0]


def test_forward_ending_with_held_backups_names_nodes_and_rank(stack):
    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0, 1], 7), per_layer=True)
    controller.submit_write(_reserve(stack, [1], 8), per_layer=True)
    with pytest.raises(PerLayerBackupIncomplete, match=r"CP rank 0: .*nodes \[7, 8\].*0/3 layers"):
        controller.end_forward()
    assert controller.held_write_node_ids == []


def test_forward_raising_mid_layers_names_nodes_and_chains_the_error(stack):
    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0, 1], 7), per_layer=True)
    controller.backup_layer(0)
    error = RuntimeError("kernel failed in layer 1")
    with pytest.raises(PerLayerBackupIncomplete, match=r"nodes \[7\].*1/3 layers.*raised") as info:
        cp_layer_backup.notify_forward_end(stack.kv_pool, error)
    assert info.value.__cause__ is error
    controller.end_forward()  # state dropped: nothing left to report


def test_a_skipped_layer_or_a_late_submit_fails_fast(stack):
    controller = stack.cache.cache_controller
    controller.submit_write(_reserve(stack, [0], 7), per_layer=True)
    with pytest.raises(PerLayerBackupIncomplete, match="layer 1 before layer 0"):
        controller.backup_layer(1)
    controller.submit_write(_reserve(stack, [0], 8), per_layer=True)
    controller.backup_layer(0)
    with pytest.raises(PerLayerBackupIncomplete, match="node 9 .*at layer 1"):
        controller.submit_write(_reserve(stack, [0], 9), per_layer=True)
    with pytest.raises(PerLayerBackupIncomplete, match="layer 2 after layer 0"):
        controller.backup_layer(2)


def test_the_pool_routes_layer_notifications_to_its_controller(stack):
    controller = stack.cache.cache_controller
    assert cp_layer_backup.listener_of(stack.kv_pool) is controller
    controller.submit_write(_reserve(stack, [0], 7), per_layer=True)
    for layer in range(LAYERS):  # model layer ids: pool-local index + start_layer
        cp_layer_backup.notify_layer_stored(stack.kv_pool, stack.kv_pool.start_layer + layer)
    assert _ack_ids(controller) == [[7]]


def test_a_held_backup_rolls_back_only_after_its_ack(stack):
    controller = stack.cache.cache_controller
    host = stack.cache.token_to_kv_pool_host
    free_before = host.available_size()
    pending = _reserve(stack, [0, 1], 7)
    controller.submit_write(pending, per_layer=True)
    with pytest.raises(CpHiCacheMetadataError, match="node 7 on CP rank 0: rollback of a per-layer"):
        controller.rollback_write(pending)
    controller.backup_layer(0)
    with pytest.raises(CpHiCacheMetadataError, match="node 7"):
        controller.rollback_write(pending)  # mid-forward: its transfer still comes
    for layer in range(1, LAYERS):
        controller.backup_layer(layer)
    controller.rollback_write(pending)  # acked (e.g. an insert miss): frees the reservation
    assert host.available_size() == free_before
