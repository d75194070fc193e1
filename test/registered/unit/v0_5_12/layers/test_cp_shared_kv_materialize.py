"""Dense buffers against SGLang's real NSATokenToKVPool (CPU), and the layer pipeline."""

from dataclasses import dataclass, field

import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import (
    STRATEGIES,
    DenseLayerKV,
    LayerMaterializationPipeline,
    PagedLayerGeometry,
    PendingDenseLayer,
    PoolPageReader,
    make_strategy,
)
from sglang_cp_hicache.v0_5_12.layers.attention.nsa_backend_hooks import dense_pool_view
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import StackConfig, build_kv_pool


@pytest.fixture(scope="module")
def nsa_pool():
    return build_kv_pool(StackConfig(layer_num=2, physical_tokens=64 * 4))


def test_geometry_and_page_views_match_the_real_pool(nsa_pool):
    geometry = PagedLayerGeometry.of_pool(nsa_pool)
    assert geometry.kv_page_bytes == 64 * 576 * 2  # bf16 latent + rope
    assert geometry.index_page_bytes == 64 * (128 + 4)
    reader = PoolPageReader(nsa_pool)
    nsa_pool.kv_buffer[1][64 * 2 + 5, 0, 7] = 3.0
    pages = reader.kv_pages(1)
    assert pages.shape == (5, geometry.kv_page_bytes)  # 4 pages + padding page
    assert pages.data_ptr() == nsa_pool.kv_buffer[1].data_ptr()
    assert reader.index_pages(1).data_ptr() == nsa_pool.index_k_with_scale_buffer[1].data_ptr()


def test_dense_buffers_are_drop_in_pool_layer_buffers(nsa_pool):
    geometry = PagedLayerGeometry.of_pool(nsa_pool)
    dense = DenseLayerKV.allocate(geometry, num_pages=3, device="cpu")
    assert dense.kv_buffer.shape == (3 * 64, 1, 576) and dense.kv_buffer.dtype == torch.bfloat16
    assert dense.index_buffer.shape == (3, 64 * 132) and dense.index_buffer.dtype == torch.uint8
    assert dense.kv_buffer.is_contiguous() and dense.index_buffer.is_contiguous()
    # one allocation, so a single collective covers both; the index block is aligned
    assert dense.flat.numel() >= 3 * (geometry.kv_page_bytes + geometry.index_page_bytes)
    assert (dense.index_buffer.data_ptr() - dense.flat.data_ptr()) % 256 == 0
    assert dense.kv_buffer.untyped_storage().data_ptr() == dense.flat.data_ptr()


def test_dense_pool_view_reads_dense_for_one_layer_and_leaves_the_pool_alone(nsa_pool):
    geometry = PagedLayerGeometry.of_pool(nsa_pool)
    dense = DenseLayerKV.allocate(geometry, 2, "cpu")
    view = dense_pool_view(nsa_pool, 1, dense)
    assert type(view) is type(nsa_pool)
    assert view.get_key_buffer(1) is dense.kv_buffer
    assert view.get_index_k_with_scale_buffer(1) is dense.index_buffer
    assert view.get_key_buffer(0) is nsa_pool.kv_buffer[0]
    assert nsa_pool.get_key_buffer(1) is nsa_pool.kv_buffer[1]
    assert nsa_pool.kv_buffer[1] is not dense.kv_buffer


def test_strategy_registry():
    assert set(STRATEGIES) == {"all_reduce", "all_gather"}
    with pytest.raises(ValueError, match="unknown"):
        make_strategy("broadcast", None)


@dataclass
class _FakeWork:
    done: bool = False

    def wait(self):
        self.done = True


@dataclass
class _RecordingStrategy:
    name: str = "fake"
    launched: list = field(default_factory=list)

    def launch(self, mapping, reader, layer_id):
        self.launched.append(layer_id)
        return PendingDenseLayer(dense=f"dense-{layer_id}", work=_FakeWork())


def test_pipeline_prefetches_the_next_layer_once_and_in_order():
    strategy = _RecordingStrategy()
    pipeline = LayerMaterializationPipeline(strategy, mapping=None, reader=None, end_layer=3, prefetch=True)
    assert pipeline.get(0) == "dense-0"
    assert strategy.launched == [0, 1]
    assert pipeline.get(0) == "dense-0"  # indexer then attention of the same layer
    assert pipeline.get(1) == "dense-1" and pipeline.get(2) == "dense-2"
    assert strategy.launched == [0, 1, 2]  # nothing past the last layer
    pipeline.close()


def test_pipeline_without_prefetch_launches_on_demand_and_close_completes_pending():
    strategy = _RecordingStrategy()
    pipeline = LayerMaterializationPipeline(strategy, None, None, end_layer=2, prefetch=False)
    pipeline.get(0)
    assert strategy.launched == [0]
    prefetching = LayerMaterializationPipeline(_RecordingStrategy(), None, None, end_layer=2)
    prefetching.get(0)
    pending = prefetching._pending[1]
    prefetching.close()
    assert pending.work.done and not prefetching._pending
