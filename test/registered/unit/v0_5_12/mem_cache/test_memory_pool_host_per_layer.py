"""Per-layer D2H backup of SGLang's NSA host pools (MLA KV and indexer K + scale).

Layer by layer, the host ends up byte-identical to SGLang's own all-layer backup, and each
call writes its layer only. Runs the strict kvcacheio stand-in on CPU (the real ops on a GPU).
"""

from typing import List, Sequence

import pytest
import torch
from torch import Tensor

from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool
from sglang.srt.mem_cache.memory_pool_host import MLATokenToKVPoolHost, NSAIndexerPoolHost

from sglang_cp_hicache.testing.device import on_side_stream
from sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup import per_layer_backup_problem
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool_host import (
    PerLayerBackupUnsupported,
    layer_backup_for,
)

LAYERS = 3
PS = 64
SUPPORTED = [("kernel", "layer_first"), ("direct", "layer_first"), ("direct", "page_first_direct")]


@pytest.fixture(autouse=True)
def write_stream():
    """The transfers on a side stream, as the controller's write stream carries them."""
    with on_side_stream():
        yield


def _device_pool() -> NSATokenToKVPool:
    return NSATokenToKVPool(
        size=16 * PS, page_size=PS, kv_lora_rank=512, qk_rope_head_dim=64, layer_num=LAYERS,
        dtype=torch.bfloat16, device="cpu", enable_memory_saver=False, index_head_dim=128,
        kv_cache_dim=576,
    )


def _host_pools(device_pool, layout: str) -> List:
    anchor = MLATokenToKVPoolHost(device_pool, 2.0, 0, PS, layout)
    return [anchor, NSAIndexerPoolHost(device_pool, anchor, layout)]


def _randomize(device_pool, gen: torch.Generator) -> None:
    for buf in [*device_pool.kv_buffer, *device_pool.index_k_with_scale_buffer]:
        raw = buf.view(torch.uint8)
        raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=gen))


def _tokens(pages: Sequence[int]) -> Tensor:
    return (torch.tensor(pages, dtype=torch.int64)[:, None] * PS + torch.arange(PS)).reshape(-1)


def _host_layer(host, layer: int) -> Tensor:
    """One layer of a host pool (KV or indexer) as bytes, one row per token (KV) or per
    page (indexer), whatever the layout."""
    buf = host.index_k_with_scale_buffer if isinstance(host, NSAIndexerPoolHost) else host.kv_buffer
    part = buf[layer] if host.layout == "layer_first" else buf[:, layer]
    return part.reshape(-1, part.shape[-1]).contiguous().view(torch.uint8)


def _rows(host, host_idx: Tensor) -> Tensor:
    return host_idx[::PS] // PS if isinstance(host, NSAIndexerPoolHost) else host_idx


def _indices(io_backend: str, layout: str):
    """Host and device token indices of 4 pages (a consecutive pair, then scattered), on the
    side each backend wants them (as the controller's ``move_indices`` leaves them)."""
    host, device = _tokens([5, 6, 2, 9]), _tokens([3, 4, 11, 1])
    if io_backend == "direct" and layout == "layer_first":
        host, order = host.sort()  # SGLang's move_indices sorts host indices for direct
        device = device[order]
    return host, device


@pytest.mark.parametrize("io_backend,layout", SUPPORTED)
def test_layer_by_layer_equals_sglangs_all_layer_backup_and_touches_one_layer(io_backend, layout):
    gen = torch.Generator().manual_seed(7)
    device_pool = _device_pool()
    _randomize(device_pool, gen)
    host_idx, device_idx = _indices(io_backend, layout)
    reference = _host_pools(device_pool, layout)
    for host in reference:
        host.backup_from_device_all_layer(device_pool, host_idx, device_idx, io_backend)

    per_layer = _host_pools(device_pool, layout)
    before = [[_host_layer(h, l).clone() for l in range(LAYERS)] for h in per_layer]
    for layer in range(LAYERS):
        for host in per_layer:
            layer_backup_for(host).backup_from_device_per_layer(
                device_pool, host_idx, device_idx, layer, io_backend
            )
        for host, ref, old in zip(per_layer, reference, before):
            rows = _rows(host, host_idx)
            for other in range(LAYERS):
                got, expected = _host_layer(host, other), old[other].clone()
                if other <= layer:  # backed up: SGLang's all-layer bytes on those rows
                    expected[rows] = _host_layer(ref, other)[rows]
                assert torch.equal(got, expected), (type(host).__name__, layer, other)
    # The reference copied real bytes (guards against comparing two empty hosts).
    for ref in reference:
        assert _host_layer(ref, LAYERS - 1)[_rows(ref, host_idx)].any()


def test_host_rows_equal_device_rows_per_layer():
    gen = torch.Generator().manual_seed(3)
    device_pool = _device_pool()
    _randomize(device_pool, gen)
    kv_host, index_host = _host_pools(device_pool, "layer_first")
    host_idx, device_idx = _indices("kernel", "layer_first")
    for layer in range(LAYERS):
        for host in (kv_host, index_host):
            layer_backup_for(host).backup_from_device_per_layer(
                device_pool, host_idx, device_idx, layer, "kernel"
            )
        assert torch.equal(  # bytes: random bf16 patterns include NaNs
            kv_host.kv_buffer[layer][host_idx].view(torch.uint8),
            device_pool.kv_buffer[layer][device_idx].view(torch.uint8),
        )
        host_pages, device_pages = host_idx[::PS] // PS, device_idx[::PS] // PS
        assert torch.equal(
            index_host.index_k_with_scale_buffer[layer][host_pages],
            device_pool.index_k_with_scale_buffer[layer][device_pages],
        )


def test_kernel_page_first_is_refused_not_emulated():
    device_pool = _device_pool()
    host_idx, device_idx = _indices("kernel", "page_first")
    for host in _host_pools(device_pool, "page_first"):
        with pytest.raises(PerLayerBackupUnsupported, match="no per-layer device->host op"):
            layer_backup_for(host).backup_from_device_per_layer(
                device_pool, host_idx, device_idx, 0, "kernel"
            )
    assert per_layer_backup_problem("kernel", "page_first") is not None
    assert all(per_layer_backup_problem(io, layout) is None for io, layout in SUPPORTED)
