"""The layer-end notification of the NSA extend hook, on the CPU twin's forward.

The twin runs a prefill forward through the real hook functions (model forward, indexer,
index-K store, extend attention) over a reference NSA pool. A listener registered on that
pool must hear each layer once, in order, only after the layer's MLA KV and index K of the
current chunk are in the pool, then the end of the forward.
"""

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List, Optional

import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
from sglang_cp_hicache.v0_5_12.mem_cache import cp_layer_backup
from sglang_cp_hicache.testing.reference_sparse_mla import ReferenceNSAPool, SparseMLAConfig
from sglang_cp_hicache.testing.v0_5_12.shared_kv_twin import TwinBatchSpec, TwinRank

CONFIG = SparseMLAConfig(num_layers=3)


@dataclass
class RecordingListener:
    """Snapshots the pool's current-chunk rows of the reported layer when told of it."""

    pool: ReferenceNSAPool
    chunk_locs: Optional[torch.Tensor] = None  # physical locs of the chunk (set per test)
    layers: List[int] = field(default_factory=list)
    kv_at_notice: dict = field(default_factory=dict)
    index_at_notice: dict = field(default_factory=dict)
    ends: List[Optional[BaseException]] = field(default_factory=list)

    def backup_layer(self, layer_id: int) -> None:
        self.layers.append(layer_id)
        pages = torch.unique(self.chunk_locs // CONFIG.page_size)
        self.kv_at_notice[layer_id] = self.pool.kv_buffer[layer_id][self.chunk_locs].clone()
        self.index_at_notice[layer_id] = self.pool.index_k_with_scale_buffer[layer_id][pages].clone()

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        self.ends.append(error)


@pytest.fixture
def twin(gloo_world1):
    return TwinRank(CONFIG, TwinBatchSpec(draft_layers=0), gloo_world1, 0, 1)


def test_each_layer_is_reported_once_in_order_after_its_stores(twin):
    listeners = []

    def pool_with_listener(config, size, device):
        pool = ReferenceNSAPool(config, size, device)
        listener = RecordingListener(pool, twin.layout.logical_locs_to_physical(twin.batch.out_cache_loc))
        cp_layer_backup.register(pool, listener)
        listeners.append(listener)
        return pool

    twin.pool_factory = pool_with_listener
    pool = twin.run_shared("all_gather", prefetch=False).target_pool
    (listener,) = listeners
    assert listener.layers == list(range(CONFIG.num_layers))
    assert listener.ends == [None]
    pages = torch.unique(listener.chunk_locs // CONFIG.page_size)
    for layer in range(CONFIG.num_layers):
        final_kv = pool.kv_buffer[layer][listener.chunk_locs]
        assert final_kv.abs().sum() > 0  # the forward stored the chunk
        assert torch.equal(listener.kv_at_notice[layer], final_kv), layer
        assert torch.equal(listener.index_at_notice[layer], pool.index_k_with_scale_buffer[layer][pages])


@dataclass
class EventLog:
    """A listener that appends (pool name, event) to a log shared by several pools."""

    name: str
    log: list

    def backup_layer(self, layer_id: int) -> None:
        self.log.append((self.name, layer_id))

    def end_forward(self, error: Optional[BaseException] = None) -> None:
        self.log.append((self.name, "end"))


def test_the_draft_pool_hears_its_layer_after_the_target_forward_ended(gloo_world1):
    """CP HiCache backs up the MTP draft's layer from the draft pool's own hook: it must
    come after every target layer and the target forward's end (the draft forward stores
    its KV after the target's), once, then the draft forward's end."""
    twin = TwinRank(CONFIG, TwinBatchSpec(draft_layers=1), gloo_world1, 0, 1)
    log, names = [], iter(["target", "draft"])

    def pool_with_listener(config, size, device):
        pool = ReferenceNSAPool(config, size, device)
        cp_layer_backup.register(pool, EventLog(next(names), log))
        return pool

    twin.pool_factory = pool_with_listener
    outputs = twin.run_shared("all_gather", prefetch=False)
    assert outputs.draft_pool is not None
    target_events = [("target", layer) for layer in range(CONFIG.num_layers)] + [("target", "end")]
    assert log == target_events + [("draft", 0), ("draft", "end")]


def test_a_raising_forward_is_reported_with_its_error():
    pool = ReferenceNSAPool(CONFIG, 16 * CONFIG.page_size, "cpu")
    listener = RecordingListener(pool)
    cp_layer_backup.register(pool, listener)
    error = RuntimeError("layer 1 failed")

    def failing_forward(self, input_ids, positions, forward_batch):
        raise error

    forward_batch = SimpleNamespace(token_to_kv_pool=pool)
    with pytest.raises(RuntimeError) as info:
        hooks.model_forward_around(failing_forward, None, None, None, forward_batch)
    assert info.value is error and listener.ends == [error]


def test_a_pool_without_listener_is_left_alone():
    pool = ReferenceNSAPool(CONFIG, 16 * CONFIG.page_size, "cpu")
    cp_layer_backup.notify_layer_stored(pool, 0)
    cp_layer_backup.notify_forward_end(pool)
    assert cp_layer_backup.listener_of(pool) is None
