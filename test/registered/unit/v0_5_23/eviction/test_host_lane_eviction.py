"""Lane-aware host room for backups on the real 0.5.23 sharded stack (cp 2, two gloo ranks).

Each scenario fills the host with chains of known owner lanes (a chain of ``k`` pages at
rotation base ``b`` holds host page ``P`` on lane ``(b + P) % 2``: host slots are
owner-matched), demotes them to host-only leaves (LRU order = fill order), host-locks some,
then inserts a new chain, whose write-through backup runs upstream's
``_execute_kv_backup``: its host floor check, ``evict_host``, the owner-matched
``alloc_cyclic``. Every scenario runs with the plugin's flag on and off in a process where
the plugin's hooks are applied; flag off is upstream's behaviour, so each assertion on the
flag-on run is one upstream fails.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2

# A host chain: (name, rotation base, pages, host-locked). Host lanes [4, 4].
Chain = Tuple[str, int, int, bool]
# The backup: (rotation base, pages) of the chain inserted last.
Backup = Tuple[int, int]

SCENARIOS: Dict[str, Tuple[List[Chain], Backup]] = {
    # free host lanes [3, 1]; the backup draws [2, 1]: it fits, yet the floor (1 page per
    # lane = 128 tokens) is below its 192 tokens.
    "fits_by_lane": ([("a", 1, 1, False), ("b", 1, 3, False)], (0, 3)),
    # free [2, 0]; the backup draws [1, 1]: lane 1 is one page short. x holds lane 0 only.
    "short_lane": ([("x", 0, 1, False), ("y", 1, 1, False), ("w", 1, 3, False),
                    ("v", 1, 1, False)], (0, 2)),
    # free [1, 0]; the backup draws [1, 1]; lane 1 is held by host-locked chains only.
    "uncoverable": ([("a", 0, 1, False), ("l1", 1, 3, True), ("l2", 1, 3, True)], (0, 2)),
    # free [0, 0]; the backup draws [2, 1] (192 tokens). x frees [1, 2]: the total, not
    # lane 0's two pages; y frees lane 1 only; z covers lane 0. (The last fill chain is
    # two pages: upstream skips a one-page backup when the floor is 0, fitting or not.)
    "stop_rule": ([("x", 1, 3, False), ("y", 1, 1, False), ("z", 0, 1, False),
                   ("w1", 0, 1, False), ("w2", 0, 2, False)], (0, 3)),
}  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """One scenario on one rank: what host eviction did for the backup."""

    host_free_before: Tuple[int, ...]
    host_free_after: Tuple[int, ...]
    evicted: Tuple[str, ...]  # host chains no longer in the tree, in fill order
    backed_up: bool  # the new chain's backup was made
    short: int
    fit: int
    refusals: int
    lane_pages_match_slots: bool


def _tokens(index: int, pages: int) -> List[int]:
    return list(range(1000 * (index + 1), 1000 * (index + 1) + pages * PAGE))


def _root_child(stack, index: int) -> Optional[Any]:
    """The tree node of chain ``index`` (each chain is its own root child), without a
    match (which would touch the LRU order)."""
    first = 1000 * (index + 1)
    for node in stack.cache.tree_core.root_node.children.values():
        if node.key.raw_token_ids()[0] == first:
            return node
    return None


def _insert(stack, index: int, base: int, pages: int) -> None:
    empty = torch.empty((0,), dtype=torch.int64)
    tokens = _tokens(index, pages)
    locs, rotation_base = stack.alloc_extend(empty, len(tokens), rotation_base=base)
    stack.insert(tokens, locs, rotation_base)


def _ack(stack) -> None:
    stack.cache.flush_pending_backups()
    stack.cache.writing_check()


def _fill_host(stack, chains: Sequence[Chain]) -> None:
    """Back the chains up, demote them all to host (fill order = LRU order), host-lock
    the locked ones."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    for index, (_, base, pages, _) in enumerate(chains):
        _insert(stack, index, base, pages)
    _ack(stack)
    stack.cache.evict(EvictParams(num_tokens=sum(c[2] for c in chains) * PAGE))
    for index, (_, _, _, locked) in enumerate(chains):
        node = _root_child(stack, index)
        assert node is not None and node.evicted and node.backuped, "not demoted to host"
        if locked:
            stack.cache.inc_host_lock_ref(node.id)


def _lane_pages_match_slots(stack) -> bool:
    """The evictor's lane pages equal the owners the rotation phase gives each host node."""
    from sglang_cp_hicache.core.rotation import run_lane_counts
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import CpCacheExtension, extension_of
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import HostLaneEvictor
    from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode

    extension = extension_of(stack.cache) or CpCacheExtension(
        stack.cache, stack.allocator, CpMode.SHARDED
    )
    evictor, core = HostLaneEvictor(extension), stack.cache.tree_core
    for node in core.evictable_host_leaves:
        phase, pages = core.rotation_phase_of(node.id), len(node.key) // PAGE
        if evictor.lane_pages(node) != run_lane_counts(phase, pages, LANES):
            return False
    return True


def _run(ctx: RankContext, name: str, cp_shared_kv: bool) -> Outcome:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import RoomStats, extension_of

    chains, (base, pages) = SCENARIOS[name]
    config = StackConfig(device_pages_per_rank=4, host_to_device_ratio=1.0, cp_shared_kv=cp_shared_kv)
    with sharded_stack(ctx, config) as stack:
        slots = stack.kv_host_pool._slots
        _fill_host(stack, chains)
        extension = extension_of(stack.cache)
        stats = RoomStats() if extension is None else extension.host_stats.paths["backup"]  # flag off: none
        before = (stats.short, stats.fit, stats.refusals)
        host_free_before = tuple(slots.class_free_page_counts())
        lane_pages_ok = _lane_pages_match_slots(stack)
        _insert(stack, len(chains), base, pages)
        _ack(stack)
        node = _root_child(stack, len(chains))
        return Outcome(
            host_free_before=host_free_before,
            host_free_after=tuple(slots.class_free_page_counts()),
            evicted=tuple(c[0] for i, c in enumerate(chains) if _root_child(stack, i) is None),
            backed_up=node.backuped,
            short=stats.short - before[0],
            fit=stats.fit - before[1],
            refusals=stats.refusals - before[2],
            lane_pages_match_slots=lane_pages_ok,
        )


def _rank(ctx: RankContext) -> Dict[Tuple[str, bool], Outcome]:
    return {(name, flag): _run(ctx, name, flag) for name in SCENARIOS for flag in (True, False)}


@pytest.fixture(scope="module")
def outcomes() -> Dict[Tuple[str, bool], Outcome]:
    per_rank = run_ranks(LANES, _rank)
    # Host lane free counts, evictions and refusals included: identical on every rank.
    assert per_rank[0] == per_rank[1], "the ranks evicted differently"
    return per_rank[0]


def test_fills_are_as_designed(outcomes) -> None:
    expected = {"fits_by_lane": (3, 1), "short_lane": (2, 0), "uncoverable": (1, 0), "stop_rule": (0, 0)}
    for name, free in expected.items():
        assert outcomes[(name, True)].host_free_before == free == outcomes[(name, False)].host_free_before
        assert outcomes[(name, True)].lane_pages_match_slots


def test_a_backup_the_free_lanes_hold_evicts_nothing(outcomes) -> None:
    plugin, upstream = outcomes[("fits_by_lane", True)], outcomes[("fits_by_lane", False)]
    assert plugin.backed_up and plugin.evicted == () and plugin.host_free_after == (1, 0)
    assert (plugin.short, plugin.fit, plugin.refusals) == (1, 1, 0)
    # Upstream counts tokens against the floor: it evicts a, for room lane 1 already had.
    assert upstream.backed_up and upstream.evicted == ("a",)


def test_a_short_lane_evicts_only_victims_on_it(outcomes) -> None:
    plugin, upstream = outcomes[("short_lane", True)], outcomes[("short_lane", False)]
    assert plugin.backed_up and plugin.evicted == ("y",)  # x holds lane 0, which has room
    assert plugin.host_free_after == (1, 0) and plugin.refusals == 0
    assert upstream.backed_up and upstream.evicted == ("x", "y")


def test_an_uncoverable_deficit_evicts_nothing_and_is_a_counted_refusal(outcomes) -> None:
    plugin, upstream = outcomes[("uncoverable", True)], outcomes[("uncoverable", False)]
    assert not plugin.backed_up and plugin.evicted == () and plugin.refusals == 1
    assert plugin.host_free_after == (1, 0)
    # Upstream evicts a (lane 0) for the token count, then skips the backup anyway.
    assert not upstream.backed_up and upstream.evicted == ("a",)


def test_host_room_stops_when_every_short_lane_is_covered_not_the_total(outcomes) -> None:
    """x frees 3 pages, the whole deficit's total, but lane 0 only one of its two: a rule
    that stops on the total evicts x alone and the backup then finds lane 0 short."""
    plugin, upstream = outcomes[("stop_rule", True)], outcomes[("stop_rule", False)]
    assert plugin.evicted == ("x", "z") and plugin.backed_up
    assert plugin.host_free_after == (0, 1) and plugin.refusals == 0
    # Upstream stops at the token count too: x alone, and the backup is skipped.
    assert upstream.evicted == ("x",) and not upstream.backed_up


def test_flag_off_is_upstreams_function_unchanged(outcomes) -> None:
    for name in SCENARIOS:
        upstream = outcomes[(name, False)]
        assert (upstream.short, upstream.fit, upstream.refusals) == (0, 0, 0)


@pytest.mark.parametrize(
    "hook, args, kwargs",
    [
        ("evict_host_around", ("cache", 128), {}),
        ("evict_host_around", ("cache", 128, "SWA"), {}),
    ],
)
def test_outside_a_lane_aware_backup_each_hook_is_upstreams_call(hook, args, kwargs) -> None:
    """Not a lane-aware cache, or no backup being made room for: upstream's function gets
    the very arguments and its result is returned, nothing else runs."""
    from sglang_cp_hicache.v0_5_23.eviction import host_lane_eviction

    calls = []

    def upstream(*a, **k):
        calls.append((a, k))
        return "upstream's result"

    assert getattr(host_lane_eviction, hook)(upstream, *args, **kwargs) == "upstream's result"
    assert calls == [(args, kwargs)]
