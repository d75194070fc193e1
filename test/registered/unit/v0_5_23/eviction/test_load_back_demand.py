"""A load-back's device demand per owner lane comes from its host slots' owners, on the real
0.5.23 sharded stack at cp 2, 4 and 8 (gloo ranks, the plugin's flag on).

Chain h of ``cp + 1`` pages (an odd count) at rotation base 1 is backed up and demoted: its
first host page is on lane 1 (host slots are owner-matched), so its load draws two pages
on lane 1 and one on every other lane. A locked chain then leaves the device lanes free
exactly that draw: the load fits only where its demand is right, and nothing on device
may be evicted. Demand taken from the first host *slot* instead of its page (a slot index
is a multiple of the page size, so its lane is 0 at cp 2, 4 and 8) asks two pages of lane
0, which has one: the load is refused.
"""

from __future__ import annotations

from typing import Dict, List

import pytest
import torch

from sglang_cp_hicache.core.rotation import lane_of, lane_page_counts
from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
DEVICE_PAGES = 3  # per lane


def _tokens(index: int, pages: int) -> List[int]:
    return list(range(10_000 * (index + 1), 10_000 * (index + 1) + pages * PAGE))


def _insert(stack, index: int, base: int, pages: int) -> List[int]:
    tokens = _tokens(index, pages)
    locs, rotation_base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens), base)
    stack.insert(tokens, locs, rotation_base)
    return tokens


def _lane_counts(locs: torch.Tensor, lanes: int) -> List[int]:
    return lane_page_counts((locs[::PAGE] // PAGE).tolist(), lanes)


def _rank(ctx: RankContext) -> Dict[str, object]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    lanes = ctx.world_size
    config = StackConfig(device_pages_per_rank=DEVICE_PAGES, host_to_device_ratio=2.0, cp_shared_kv=True)
    with sharded_stack(ctx, config) as stack:
        h = _insert(stack, 0, base=1, pages=lanes + 1)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        stack.cache.evict(EvictParams(num_tokens=len(h)))
        host_node = stack.match(h).last_host_node
        # A locked run of lanes * (DEVICE_PAGES - 1) - 1 pages ending on lane 1 (base 2):
        # DEVICE_PAGES - 1 pages on every lane but lane 1, one fewer there.
        filler = _insert(stack, 1, base=2 % lanes, pages=lanes * (DEVICE_PAGES - 1) - 1)
        stack.cache.inc_lock_ref(stack.match(filler).last_device_node)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        report: Dict[str, object] = {
            "first_host_lane": _first_host_lane(stack.cache.tree_core.node_by_id(host_node), lanes),
            "free_before": tuple(stack.allocator.class_free_page_counts()),
        }
        report["loaded"] = bool(stack.cache.load_back(host_node))
        stack.cache.ready_to_load_host_cache()
        stack.cache.loading_check()
        match = stack.match(h)
        report["on_device"] = match.device_prefix_len == len(h)
        report["filler_on_device"] = stack.match(filler).device_prefix_len == len(filler)
        device_locs = stack.cache.path_device_indices(match.last_device_node)[: len(h)]
        report["device_lanes"] = tuple(_lane_counts(device_locs, lanes))
        report["free_after"] = tuple(stack.allocator.class_free_page_counts())
    return report


def _first_host_lane(node, lanes: int) -> int:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return lane_of(int(node.component_data[ComponentType.FULL].host_value[0]) // PAGE, lanes)


@pytest.mark.parametrize("cp_size", [2, 4, 8])
def test_a_load_back_from_lane_1_draws_per_lane_from_its_host_pages(cp_size) -> None:
    reports = run_ranks(cp_size, _rank)
    assert all(report == reports[0] for report in reports), "the ranks decided differently"
    report = reports[0]
    demand = tuple(2 if lane == 1 else 1 for lane in range(cp_size))
    assert report["first_host_lane"] == 1
    assert report["free_before"] == demand, report  # the device lanes hold exactly the draw
    assert report["loaded"] and report["on_device"], f"the load was refused: {report}"
    assert report["device_lanes"] == demand and report["free_after"] == (0,) * cp_size, report
    assert report["filler_on_device"]
