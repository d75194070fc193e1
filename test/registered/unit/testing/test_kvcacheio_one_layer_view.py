"""The fallback of ``docs/per_layer_page_first.md`` (section 2): sglang-kernel's all-layer
``transfer_kv_all_layer_mla_lf_pf`` with ``num_layers=1``, a one-entry pointer table and a
per-layer view of a ``page_first`` host buffer as ``dst`` backs up exactly that layer (its
addressing ``dst.data_ptr() + i * dst_layout_dim + 0 * item_size`` is the page_first address
of ``(i, layer)``), through the CPU reference op of ``testing/kvcacheio.py``. Imports no
SGLang (runs in both venvs)."""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.testing import kvcacheio

LAYERS = 4


@pytest.mark.parametrize("item_bytes", [656, 1152, 64 * 132])
def test_one_layer_through_the_all_layer_op_over_a_per_layer_view(item_bytes: int) -> None:
    g = torch.Generator().manual_seed(item_bytes)
    host = torch.randint(0, 256, (6, LAYERS, 1, item_bytes), generator=g, dtype=torch.uint8)
    device = torch.randint(0, 256, (8, item_bytes), generator=g, dtype=torch.uint8)
    expected = host.clone()
    layer, device_idx, host_idx = 2, torch.tensor([5, 0, 7]), torch.tensor([1, 4, 3])
    kvcacheio.transfer_kv_all_layer_mla_lf_pf(
        src_layers=torch.tensor([device.data_ptr()], dtype=torch.uint64),
        dst=host.transpose(0, 1)[layer],
        src_indices=device_idx,
        dst_indices=host_idx,
        item_size=item_bytes,
        dst_layout_dim=LAYERS * item_bytes,
        num_layers=1,
    )
    expected[host_idx, layer, 0] = device[device_idx]
    assert torch.equal(host, expected)
