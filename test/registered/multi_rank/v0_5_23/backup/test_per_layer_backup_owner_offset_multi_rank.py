"""A per-layer reservation's host slots for a request extending a cached prefix start on the
owner lane of its first NEW page (cp 2, the real 0.5.23 sharded stack, gloo ranks, the
plugin's flag on).

The cached prefix is 3 pages (odd), the extension 3 pages (odd): the reservation
(``reserve_batch``, what the ``Scheduler.run_batch`` hook calls) must draw its host slots
from lane ``(rotation base + 3) % 2``, not from the chain's base. Each reserved host page
must sit on its device page's lane, and the KV must come back byte-exact: after the
forward's per-layer copies and the ack, the device is evicted and zeroed and the node
loaded back from host. A reservation at the wrong owner offset puts each rank's rows in
host slots another rank owns; only 4-minute simulator runs caught that before. Both host
layouts, ``layer_first`` and ``page_first``.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from sglang_cp_hicache.core.rotation import lane_of
from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2
LAYERS = 2
PREFIX_PAGES = 3
NEW_PAGES = 3
SEED = 20261205
PREFIX = list(range(1, PREFIX_PAGES * PAGE + 1))
REQUEST = PREFIX + list(range(50_001, 50_001 + NEW_PAGES * PAGE))


def _device_mismatches(stack, locs: torch.Tensor, kv) -> List[str]:
    """Owned device latent rows and indexer pages at ``locs`` that differ from ``kv``."""
    latent, indexer = kv
    owned = stack.owned_mask(locs)
    rows = stack.physical_rows(locs)
    first = locs[::PAGE]
    owned_pages = torch.nonzero(stack.owned_mask(first)).squeeze(1)
    page_rows = stack.physical_rows(first) // PAGE
    bad = []
    for layer in range(LAYERS):
        differs = (stack.kv_pool.kv_buffer[layer][rows] != latent[layer][owned]).flatten(1).any(1)
        bad += [f"layer {layer} latent row {int(r)}" for r in rows[differs]]
        differs = (stack.kv_pool.index_k_with_scale_buffer[layer][page_rows] != indexer[layer][owned_pages]).any(1)
        bad += [f"layer {layer} indexer page {int(p)}" for p in page_rows[differs]]
    return bad


def _rank(ctx: RankContext, layout: str) -> Dict[str, object]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import extend_batch, forward
    from sglang_cp_hicache.testing.v0_5_23.owned_kv import logical_kv
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import reserve_batch

    report: Dict[str, object] = {}
    with sharded_stack(ctx, StackConfig(layer_num=LAYERS, cp_shared_kv=True, mem_layout=layout)) as stack:
        locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(PREFIX), 0)
        stack.insert(PREFIX, locs, base)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        batch = extend_batch(stack, [REQUEST])
        (req,) = batch.reqs
        report["cached_prefix"] = req.kv.cache_protected_len
        report["per_layer"] = req.rid in reserve_batch(stack.cache, batch.reqs)
        new_locs = batch.out_cache_loc
        kv = logical_kv(stack, len(new_locs), LAYERS, SEED)
        forward(stack, [(new_locs, kv)])
        row = stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(REQUEST)].to(torch.int64)
        stack.insert(REQUEST, row, req.kv_rotation_base, cached_len=len(PREFIX))
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        leaf = stack.cache.tree_core.node_by_id(stack.match(REQUEST).last_device_node)
        host = leaf.component_data[ComponentType.FULL].host_value
        report["leaf_pages"] = len(host) // PAGE
        report["device_lanes"] = lane_of(new_locs[::PAGE] // PAGE, LANES).tolist()
        report["host_lanes"] = lane_of(host[::PAGE] // PAGE, LANES).tolist()
        stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
        for layer in range(LAYERS):  # the reload must write every byte it is checked on
            stack.kv_pool.kv_buffer[layer].zero_()
            stack.kv_pool.index_k_with_scale_buffer[layer].zero_()
        match = stack.match(REQUEST)
        report["host_hit"] = match.host_hit_length
        report["loaded"] = bool(stack.cache.load_back(match.last_host_node))
        stack.cache.ready_to_load_host_cache()
        stack.cache.loading_check()
        reloaded = stack.cache.path_device_indices(stack.match(REQUEST).last_device_node)
        report["reload_mismatches"] = _device_mismatches(stack, reloaded[len(PREFIX) :], kv)[:8]
    return report


@pytest.fixture(scope="module", params=("layer_first", "page_first"))
def per_rank(request) -> List[Dict[str, object]]:
    return run_ranks(LANES, _rank, request.param)


def test_the_extension_of_a_cached_prefix_is_reserved_per_layer(per_rank) -> None:
    for rank, report in enumerate(per_rank):
        assert report["cached_prefix"] == len(PREFIX), f"rank {rank}: {report}"
        assert report["per_layer"] and report["leaf_pages"] == NEW_PAGES, f"rank {rank}: {report}"


def test_each_reserved_host_page_is_on_its_device_pages_lane(per_rank) -> None:
    for rank, report in enumerate(per_rank):
        assert report["host_lanes"] == report["device_lanes"], f"rank {rank}: {report}"


def test_the_extension_comes_back_byte_exact_from_host(per_rank) -> None:
    for rank, report in enumerate(per_rank):
        # The request still holds its matched prefix on device: the leaf alone is on host.
        assert report["loaded"] and report["host_hit"] == NEW_PAGES * PAGE, f"rank {rank}: {report}"
        assert report["reload_mismatches"] == [], f"rank {rank}"
