"""One layer of a D2H backup on a model whose DSA indexer is on some layers only (shared
top-k: a layer that reuses another layer's top-k has no indexer buffer), on SGLang 0.5.23's
real unsharded stack, both host layouts.

Upstream gives such a layer a 0-row device placeholder and no host layer: the indexer host
pool's layers are compact (``DSAIndexerPoolHost._device_to_host_layer``) and its pool
entry's ``layer_mapper`` answers None for the layer (``_filter_owned_layer_mapping`` over
``owned_device_layers``). ``L2LayerTransfers.copy_layer`` is called for every target layer;
each layer's latent must land on the host, and the indexer's pages only for the layers that
hold them, each in its own compact host layer.
"""

from __future__ import annotations

import pytest
import torch

PAGE = 64
LAYERS = 3
SKIP_TOPK = (False, True, False)  # layer 1 reuses layer 0's top-k
LAYOUTS = ("layer_first", "page_first")


def _fill_device(stack, locs: torch.Tensor) -> None:
    """Seeded latent rows on every layer, seeded index pages on the layers with an indexer."""
    generator = torch.Generator().manual_seed(36)
    pool = stack.kv_pool
    pages = locs[::PAGE] // PAGE
    for layer in range(LAYERS):
        rows = pool.kv_buffer[layer][locs]
        pool.kv_buffer[layer][locs] = torch.randn(rows.shape, generator=generator).to(rows.dtype)
        if not SKIP_TOPK[layer]:
            index = pool.index_k_with_scale_buffer[layer]
            index[pages] = torch.randint(0, 256, index[pages].shape, generator=generator).to(index.dtype)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_layer_backs_up_its_latent_and_only_indexer_layers_their_pages(gloo_world1, layout: str) -> None:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import host_indexer_layer, host_latent_layer
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack
    from sglang_cp_hicache.v0_5_23.backup.l2_transfer import L2LayerTransfers, ReservedWrite, per_layer_problem

    config = StackConfig(layer_num=LAYERS, device_pages_per_rank=4, mem_layout=layout, skip_topk_layers=SKIP_TOPK)
    with build_unsharded_stack(gloo_world1, config) as stack:
        indexer_host = stack.indexer_host_pool
        assert indexer_host.target_layer_num == 2  # upstream's compact host layers: device 0 and 2
        assert per_layer_problem(stack.controller) is None
        locs, _ = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), 2 * PAGE)
        _fill_device(stack, locs)
        controller = stack.controller
        sidecar = stack.cache._build_backup_sidecar(locs, {})
        host, pool_transfers = controller.allocate_host_transfers(locs, sidecar or None)
        transfers = L2LayerTransfers(controller)
        merged = transfers.merge([ReservedWrite(-2, host, locs, pool_transfers or None)])
        for layer in range(LAYERS):
            transfers.copy_layer(merged, layer)

        pool = stack.kv_pool
        for layer in range(LAYERS):
            device = pool.kv_buffer[layer][locs]
            on_host = host_latent_layer(stack.kv_host_pool, layer)[host].view(device.dtype).reshape(device.shape)
            assert torch.equal(on_host, device), f"layer {layer} latent"
        device_pages, host_pages = locs[::PAGE] // PAGE, host[::PAGE] // PAGE
        for host_layer, layer in enumerate(layer for layer in range(LAYERS) if not SKIP_TOPK[layer]):
            device = pool.index_k_with_scale_buffer[layer][device_pages]
            assert device.any(), "the seeded index pages are not blank"
            assert torch.equal(host_indexer_layer(indexer_host, host_layer)[host_pages], device), (
                f"layer {layer}'s index pages in host layer {host_layer}"
            )
