"""CP load planning in NumPy: same answers as the metadata reference.

``CpHybridCacheController.load`` plans from the host page table directly (no per-node
metadata object, whole-page nodes returned without re-mapping). For every owner pattern,
with and without a partial tail page, on ranks that own all, some or none of the pages,
the queued transfer and the returned locs must equal what ``CpHostPageTable.node_metadata``
and ``expand_valid_locs`` give.
"""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.mem_cache.cp_hicache_metadata import (
    CpHiCacheMetadataError,
    expand_valid_locs,
    pages_to_token_locs,
)
from sglang_cp_hicache.testing import nsa_stack

PS = 64
CASES = [
    # (cp_size, cp_rank, page owners, valid tokens in the last page)
    (2, 0, [0, 0, 0], PS),  # owns everything
    (2, 0, [1, 1], PS),  # owns nothing
    (2, 0, [0, 1, 1, 0, 1], PS),
    (2, 1, [0, 1, 0], 10),  # partial tail page
    (3, 1, [2, 1, 0, 1], 33),
    (3, 2, [0, 0], 1),
]


@pytest.mark.parametrize("cp_size,cp_rank,owners,tail", CASES)
def test_load_plan_matches_metadata_reference(gloo_world1, cp_size, cp_rank, owners, tail):
    cfg = nsa_stack.StackConfig(cp_size=cp_size, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, cp_rank, None, gloo_world1)
    controller = stack.cache.cache_controller
    extra = stack.cache._get_extra_pools
    full = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
    host_locs = controller.write(full[: len(full) - PS + tail], node_id=7, **extra())
    metadata = controller.host_table.node_metadata(host_locs, 7)

    new_locs = controller.load(host_locs, node_id=8, **extra())
    (op,) = controller.load_queue
    new_pages = new_locs[::PS]  # every page of the node starts at a multiple of PS
    assert torch.equal(new_locs, expand_valid_locs(pages_to_token_locs(new_pages // PS, PS), host_locs, PS))
    assert stack.layout.page_owners_of_locs(new_locs).tolist() == owners
    owned = metadata.page_owners == cp_rank
    owned_host_pages = metadata.host_indices[metadata.owned_positions % PS == 0] // PS
    assert torch.equal(op.host_indices, pages_to_token_locs(owned_host_pages, PS))
    expected_device = pages_to_token_locs(stack.layout.logical_pages_to_physical(new_pages[owned] // PS), PS)
    assert torch.equal(op.device_indices, expected_device)
    assert op.node_ids == [8]
    stack.close()


def test_load_of_an_unallocated_host_page_names_node_and_rank(gloo_world1):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, layer_num=1)
    stack = nsa_stack.build_rank_stack(cfg, 1, None, gloo_world1)
    controller = stack.cache.cache_controller
    host_locs = controller.write(stack.allocator.alloc(2 * PS), node_id=3, **stack.cache._get_extra_pools())
    controller.release_host(host_locs)
    with pytest.raises(CpHiCacheMetadataError, match="node 4 on CP rank 1"):
        controller.load(host_locs, node_id=4)
    stack.close()
