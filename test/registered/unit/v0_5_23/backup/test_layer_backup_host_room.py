"""Host room for a per-layer backup's reservation is made for everything the backup draws
(the real 0.5.23 sharded stack, cp 2, two gloo ranks, the plugin's flag on).

The host holds three demoted chains (host lanes [4, 4], free [1, 1]: both lanes partly
full). A new 3-page request, reserved before its forward through ``reserve_batch`` (what
the ``Scheduler.run_batch`` hook calls), draws two pages on its first lane and one on the
other: the host floor (one page per lane, 128 tokens) is 64 tokens short of its 192. Room
made for those 64 tokens only (one page on the first lane) looks like a fit, evicts
nothing, and the owner-matched allocation then fails: the reservation is refused and the
node silently falls back to upstream's all-layer backup at its insert. Room made for the
whole draw evicts the one host chain that frees a page on the short lane, and the backup
is per layer. Both host layouts, ``layer_first`` and ``page_first``.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2
# Host chains: (name, rotation base, pages), demoted in this order (the LRU order).
FILL: Tuple[Tuple[str, int, int], ...] = (("a", 0, 1), ("c", 1, 1), ("d", 0, 4))
NEW_PAGES = 3


def _tokens(index: int, pages: int) -> List[int]:
    return list(range(1000 * (index + 1), 1000 * (index + 1) + pages * PAGE))


def _root_child(stack, index: int) -> Optional[Any]:
    """Chain ``index``'s node (each chain is a root child), read without a match."""
    first = 1000 * (index + 1)
    for node in stack.cache.tree_core.root_node.children.values():
        if node.key.raw_token_ids()[0] == first:
            return node
    return None


def _fill_host(stack, chains: Sequence[Tuple[str, int, int]]) -> None:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    empty = torch.empty((0,), dtype=torch.int64)
    for index, (_, base, pages) in enumerate(chains):
        tokens = _tokens(index, pages)
        locs, rotation_base = stack.alloc_extend(empty, len(tokens), rotation_base=base)
        stack.insert(tokens, locs, rotation_base)
    stack.cache.flush_pending_backups()
    stack.cache.writing_check()
    stack.cache.evict(EvictParams(num_tokens=sum(c[2] for c in chains) * PAGE))
    for index in range(len(chains)):
        node = _root_child(stack, index)
        assert node is not None and node.evicted and node.backuped, "not demoted to host"


def _rank(ctx: RankContext, layout: str) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import extend_batch
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import layer_backup_of, reserve_batch
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    config = StackConfig(device_pages_per_rank=4, host_to_device_ratio=1.0, cp_shared_kv=True, mem_layout=layout)
    with sharded_stack(ctx, config) as stack:
        slots = stack.kv_host_pool._slots
        _fill_host(stack, FILL)
        free_before = tuple(slots.class_free_page_counts())
        floor_before = stack.host_available()
        batch = extend_batch(stack, [_tokens(len(FILL), NEW_PAGES)])
        (req,) = batch.reqs
        tickets = reserve_batch(stack.cache, batch.reqs)
        return {
            "free_before": free_before,
            "floor_before": floor_before,
            "base": req.kv_rotation_base,
            "per_layer": req.rid in tickets,
            "refused": layer_backup_of(stack.cache).refused,
            "evicted": tuple(c[0] for i, c in enumerate(FILL) if _root_child(stack, i) is None),
            "plans_by_path": {
                p: r.plans for p, r in extension_of(stack.cache).host_stats.paths.items()
            },
            "free_after": tuple(slots.class_free_page_counts()),
        }


@pytest.fixture(scope="module", params=("layer_first", "page_first"))
def per_rank(request) -> List[Dict[str, object]]:
    reports = run_ranks(LANES, _rank, request.param)
    assert reports[0] == reports[1], "the ranks decided differently"
    return reports


def test_the_fill_leaves_the_tightest_host_lane_partly_full_and_the_floor_short(per_rank) -> None:
    report = per_rank[0]
    assert report["free_before"] == (1, 1)
    assert report["floor_before"] == LANES * PAGE < NEW_PAGES * PAGE


def test_the_reservation_makes_room_for_its_whole_draw_and_is_per_layer(per_rank) -> None:
    report = per_rank[0]
    short_lane = owner_of(report["base"], 0, LANES)  # the run's first lane draws two pages
    assert report["per_layer"], f"the reservation was refused: {report}"
    assert report["refused"] == 0
    # Only the one-page chain on the short lane is evicted (a or c), never d.
    assert report["evicted"] == (("a", "c")[short_lane],), report
    assert report["free_after"] == (0, 0), report  # [1, 1] + the victim's page - the draw
    # counted as the per-layer reservation's room (the extension's host_stats, by path)
    assert report["plans_by_path"] == {"backup": 0, "layer_backup": 1, "storage_hit": 0}, report
