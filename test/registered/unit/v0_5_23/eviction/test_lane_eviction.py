"""Lane-aware device eviction on the real 0.5.23 sharded stack (cp 2, two gloo ranks).

Each scenario fills the device with chains of known owner lanes (a chain of ``k`` pages at
rotation base ``b`` holds position-page ``P`` on lane ``(b + P) % 2``), then asks for room
through upstream's own entry points: ``alloc_paged_token_slots_extend`` (an extend) and
``UnifiedRadixCache.evict_for_alloc`` (what a load-back calls), and a real load-back
(``UnifiedRadixCache.load_back``) of a chain on host. Every scenario runs with the
plugin's flag on and off in a process where the plugin's hooks are applied; flag off is
upstream's behaviour, so each assertion on the flag-on run is one upstream fails.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Dict, List, Optional, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.core.rotation import lane_of, lane_page_counts
from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2

# A chain: (name, rotation base, pages, locked). Inserted in order, so the LRU order is
# the list order; each chain's first token is distinct (its own root child).
Chain = Tuple[str, int, int, bool]

SCENARIOS: Dict[str, List[Chain]] = {
    # free lanes [2, 1]: a new 3-page chain starts on lane 0 and draws [2, 1].
    "extend_fits": [("p", 0, 2, False), ("q", 1, 3, False)],
    # free lanes [1, 0]: the floor needs one page on lane 1 only.
    "one_lane": [("c0", 0, 1, False), ("c1", 1, 1, False), ("c2", 1, 1, False),
                 ("c3", 1, 2, False), ("c4", 0, 2, False)],
    # free lanes [0, 1], two pages per lane wanted: deficit [2, 1]. x frees [1, 2] (the
    # total is met, lane 0 is not); y frees lane 1 only; z covers lane 0.
    "stop_rule": [("x", 1, 3, False), ("y", 1, 1, False), ("z", 0, 1, False),
                  ("w", 0, 1, False), ("v", 0, 1, False)],
    # free lanes [0, 0]; lane 1 is held by a locked chain: lane 1 cannot be covered.
    "uncoverable": [("a", 0, 1, False), ("locked", 1, 7, True)],
    # free lanes [0, 0]; the only evictable lane-0 page is an inner node's: a branch whose
    # shared first page (lane 0) has two one-page children (lane 1), added by _run.
    "through_parent": [("locked", 0, 5, True)],
    # h (3 pages at base 0: lanes [2, 1]) goes to host, then p and q leave free lanes
    # [2, 1]: h's load draws exactly what is free; the floor wants 2 pages on lane 1.
    "load_exact": [("h", 0, 3, False), ("p", 0, 2, False), ("q", 1, 3, False)],
    # nothing cached, free lanes [4, 4]: two new 2-page chains, one extend each; the first
    # leaves the lanes tied again ([3, 3]).
    "spread": [],
}  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    """One scenario on one rank: what was evicted and what the allocator had."""

    free_before: Tuple[int, ...]
    free_after: Tuple[int, ...]
    evicted: Tuple[str, ...]  # chains no longer on device, in fill order
    refusals: int
    extend_lanes: Optional[Tuple[int, ...]]  # the extend's pages per lane (extend only)
    lane_pages_match_locs: bool
    loaded: Optional[bool] = None  # the load-back's result (load_exact only)
    new_chain_bases: Optional[Tuple[int, ...]] = None  # the extends' bases (spread only)
    # After the room was made: both tiers' persistent candidate heaps (LRU: kept across
    # plans) give the order of a heap rebuilt over the tree core's leaf sets.
    candidates_match_rebuild: bool = True


def _tokens(index: int, pages: int) -> List[int]:
    return list(range(1000 * (index + 1), 1000 * (index + 1) + pages * PAGE))


def _fill(stack, chains: Sequence[Chain], first_index: int = 0) -> None:
    empty = torch.empty((0,), dtype=torch.int64)
    for index, (_, base, pages, locked) in enumerate(chains, start=first_index):
        tokens = _tokens(index, pages)
        locs, rotation_base = stack.alloc_extend(empty, len(tokens), rotation_base=base)
        stack.insert(tokens, locs, rotation_base)
        if locked:
            stack.cache.inc_lock_ref(stack.match(tokens).last_device_node)
    stack.cache.flush_pending_backups()
    stack.cache.writing_check()  # the backups' acks: every chain is evictable (demotable)


def _fill_branch(stack) -> None:
    """Keys p+a then p+b at base 0: node p (position-page 0, lane 0) with children a, b
    (position-page 1, lane 1)."""
    empty = torch.empty((0,), dtype=torch.int64)
    tokens_a = _tokens(50, 2)
    locs_a, base = stack.alloc_extend(empty, len(tokens_a), rotation_base=0)
    stack.insert(tokens_a, locs_a, base)
    tokens_b = tokens_a[:PAGE] + [t + 500 for t in tokens_a[PAGE:]]
    locs_b, _ = stack.alloc_extend(locs_a[:PAGE], len(tokens_b), rotation_base=base)
    stack.insert(tokens_b, torch.cat([locs_a[:PAGE], locs_b]), base, cached_len=PAGE)


def _on_device(stack, chains: Sequence[Chain]) -> List[bool]:
    return [
        stack.match(_tokens(index, pages)).device_prefix_len == pages * PAGE
        for index, (_, _, pages, _) in enumerate(chains)
    ]


def _lane_pages_match_locs(stack) -> bool:
    """The evictor's phase-derived lane pages equal the owners of every node's locs."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
    from sglang_cp_hicache.v0_5_23.eviction.lane_eviction import DeviceLaneEvictor

    evictor = DeviceLaneEvictor(extension_of(stack.cache))
    nodes = list(stack.cache.tree_core.root_node.children.values())
    while nodes:
        node = nodes.pop()
        nodes.extend(node.children.values())
        value = node.component_data[ComponentType.FULL].value
        if value is None:
            continue
        if evictor.lane_pages(node) != lane_page_counts((value[::PAGE] // PAGE).tolist(), LANES):
            return False
    return True


def _candidates_match_rebuild(stack) -> bool:
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
    from sglang_cp_hicache.v0_5_23.eviction.host_lane_eviction import HostLaneEvictor
    from sglang_cp_hicache.v0_5_23.eviction.lane_eviction import DeviceLaneEvictor

    extension = extension_of(stack.cache)
    tree_core = stack.cache.tree_core
    device, host = DeviceLaneEvictor(extension), HostLaneEvictor(extension)
    host_priority = host._component().session_ref_eviction_strategy

    def rebuilt(leaves, priority):
        return [node for _, _, node in sorted((priority(n), n.id, n) for n in leaves)]

    return (
        extension.device_leaves.keys_only_grow
        and extension.host_leaves.keys_only_grow
        and list(device.candidates(device.priority))
        == rebuilt(tree_core.evictable_device_leaves, device.priority)
        and list(host.candidates(host_priority))
        == rebuilt(tree_core.evictable_host_leaves, host_priority)
    )


def _extend(stack, pages: int, index: int = 99) -> Tuple[Tuple[int, ...], int]:
    """A new chain of ``pages`` pages (``_tokens(index, ...)``) through upstream's extend
    allocation, real Req and ScheduleBatch; its pages per lane and its first page's lane."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req(
        rid="extend",
        origin_input_text="",
        origin_input_ids=array("q", _tokens(index, pages)),
        sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
    )
    batch = ScheduleBatch(
        reqs=[req],
        req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator,
        tree_cache=stack.cache,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        device="cpu",
    )
    zero, seq = torch.tensor([0]), torch.tensor([pages * PAGE])
    locs = alloc_paged_token_slots_extend(
        tree_cache=stack.cache, prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=seq,
        seq_lens_cpu=seq, last_loc=torch.tensor([-1]), extend_num_tokens=pages * PAGE,
        batch=batch,
    )  # fmt: skip
    logical_pages = (locs[::PAGE] // PAGE).tolist()
    return tuple(lane_page_counts(logical_pages, LANES)), lane_of(logical_pages[0], LANES)


def _run(ctx: RankContext, name: str, cp_shared_kv: bool) -> Outcome:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import LaneEvictionStats, extension_of

    chains = SCENARIOS[name]
    config = StackConfig(device_pages_per_rank=4, host_to_device_ratio=4.0, cp_shared_kv=cp_shared_kv)
    with sharded_stack(ctx, config) as stack:
        if name == "through_parent":
            _fill_branch(stack)
        if name == "load_exact":
            _fill(stack, chains[:1])
            stack.cache.evict(EvictParams(num_tokens=chains[0][2] * PAGE))  # h to host
            _fill(stack, chains[1:], first_index=1)
        else:
            _fill(stack, chains)
        free_before = tuple(stack.allocator.class_free_page_counts())
        lane_pages_ok = _lane_pages_match_locs(stack) if cp_shared_kv else True
        extension = extension_of(stack.cache)
        stats = LaneEvictionStats() if extension is None else extension.device_stats  # flag off: none
        refusals, extend_lanes, loaded, bases = stats.total("refusals"), None, None, None
        if name == "extend_fits":
            extend_lanes, _ = _extend(stack, pages=3)
        elif name == "spread":
            bases = tuple(_extend(stack, pages=2, index=90 + i)[1] for i in range(2))
        elif name == "load_exact":
            loaded = stack.cache.load_back(stack.match(_tokens(0, chains[0][2])).last_host_node)
            stack.cache.ready_to_load_host_cache()
            stack.cache.loading_check()
        else:
            wanted = {"one_lane": 128, "stop_rule": 256, "uncoverable": 128, "through_parent": 128}[name]
            stack.cache.evict_for_alloc(EvictParams(num_tokens=wanted - stack.device_available()))
        evicted = [c[0] for c, on in zip(chains, _on_device(stack, chains)) if not on]
        return Outcome(
            free_before=free_before,
            free_after=tuple(stack.allocator.class_free_page_counts()),
            evicted=tuple(evicted),
            refusals=stats.total("refusals") - refusals,
            extend_lanes=extend_lanes,
            lane_pages_match_locs=lane_pages_ok,
            loaded=loaded,
            new_chain_bases=bases,
            candidates_match_rebuild=_candidates_match_rebuild(stack) if cp_shared_kv else True,
        )


def _rank(ctx: RankContext) -> Dict[Tuple[str, bool], Outcome]:
    return {(name, flag): _run(ctx, name, flag) for name in SCENARIOS for flag in (True, False)}


@pytest.fixture(scope="module")
def outcomes() -> Dict[Tuple[str, bool], Outcome]:
    per_rank = run_ranks(LANES, _rank)
    assert per_rank[0] == per_rank[1], "the ranks evicted differently"
    return per_rank[0]


def test_fills_are_as_designed(outcomes) -> None:
    expected = {
        "extend_fits": (2, 1), "one_lane": (1, 0), "stop_rule": (0, 1), "uncoverable": (0, 0),
        "through_parent": (0, 0), "load_exact": (2, 1), "spread": (4, 4),
    }  # fmt: skip
    for name, free in expected.items():
        assert outcomes[(name, True)].free_before == free == outcomes[(name, False)].free_before


def test_lane_pages_come_from_the_rotation_phase_and_match_the_locs(outcomes) -> None:
    assert all(outcomes[(name, True)].lane_pages_match_locs for name in SCENARIOS)


def test_the_persistent_candidate_heaps_keep_the_rebuilt_order(outcomes) -> None:
    assert all(outcome.candidates_match_rebuild for outcome in outcomes.values())


def test_an_extend_the_free_lanes_can_hold_evicts_nothing(outcomes) -> None:
    plugin, upstream = outcomes[("extend_fits", True)], outcomes[("extend_fits", False)]
    assert plugin.evicted == () and plugin.extend_lanes == (2, 1) and plugin.refusals == 0
    # Upstream sizes its eviction for one extra page per lane per request: it flushes.
    assert upstream.evicted != ()


def test_a_new_chain_starts_opposite_the_chains_started_before(outcomes) -> None:
    """Two new chains on tied lanes: upstream starts both on lane 0 (ties to the lowest),
    so every request continuing either lays its odd page on lane 0; the plugin starts the
    second on lane 1. Neither extend evicts."""
    plugin, upstream = outcomes[("spread", True)], outcomes[("spread", False)]
    assert plugin.new_chain_bases == (0, 1) and upstream.new_chain_bases == (0, 0)
    assert plugin.free_after == upstream.free_after == (2, 2) and plugin.evicted == ()


def test_a_one_lane_deficit_evicts_only_nodes_on_that_lane(outcomes) -> None:
    plugin, upstream = outcomes[("one_lane", True)], outcomes[("one_lane", False)]
    assert plugin.evicted == ("c1",)  # c0 holds lane 0 only; c2 is not needed
    assert plugin.free_after == (1, 1)
    assert upstream.evicted == ("c0", "c1")  # the LRU flushes the lane that had room


def test_eviction_stops_when_every_short_lane_is_covered_not_the_total(outcomes) -> None:
    plugin, upstream = outcomes[("stop_rule", True)], outcomes[("stop_rule", False)]
    # x alone frees the total (3 pages for a deficit of 2 + 1), not lane 0's two pages.
    assert plugin.evicted == ("x", "z")
    assert plugin.free_after == (2, 3)
    assert upstream.evicted == ("x", "y", "z")


def test_an_uncoverable_deficit_evicts_nothing_and_is_counted(outcomes) -> None:
    plugin, upstream = outcomes[("uncoverable", True)], outcomes[("uncoverable", False)]
    assert plugin.evicted == () and plugin.refusals == 1 and plugin.free_after == (0, 0)
    assert upstream.evicted == ("a",) and upstream.refusals == 0


def test_a_load_back_the_free_lanes_can_hold_loads_without_evicting(outcomes) -> None:
    """The load's draws per lane come from its host slots' owners: [2, 1] fits free
    [2, 1]. Upstream gates on the floor (2 pages on every lane) and flushes p for it."""
    plugin, upstream = outcomes[("load_exact", True)], outcomes[("load_exact", False)]
    assert plugin.loaded and plugin.evicted == () and plugin.free_after == (0, 0)
    assert plugin.refusals == 0
    assert upstream.loaded and upstream.evicted == ("p",)


def test_a_short_lane_held_by_an_inner_node_is_reached_through_its_children(outcomes) -> None:
    """Lane 0's only evictable page is the branch node p's: both its lane-1 children go
    (the second only to free p), then p; no refusal, where leaves-only planning refuses."""
    plugin = outcomes[("through_parent", True)]
    assert plugin.refusals == 0 and plugin.free_after == (1, 2)


def test_flag_off_is_upstreams_function_unchanged(outcomes) -> None:
    """Flag off, the hooks call upstream's functions as they are: nothing counted."""
    assert all(outcomes[(name, False)].refusals == 0 for name in SCENARIOS)
    assert outcomes[("extend_fits", False)].extend_lanes is not None


@pytest.mark.parametrize(
    "hook, args, kwargs",
    [
        ("evict_until_allocatable_around", ("cache", "allocator", 128), {}),
        ("evict_for_alloc_around", ("cache", "params"), {"allocation_reclaim_satisfied": None}),
        (
            "alloc_paged_token_slots_extend_around",
            ("cache", "p", "pc", "s", "sc", "l", 64),
            {"req_pool_indices": None, "batch": "batch"},
        ),
        (
            "kv_shard_rotation_bases_around",
            (),
            {"tree_cache": "c", "batch": "b", "prefix_lens_cpu": "p"},
        ),
        ("load_back_transfers_around", ("cache",), {"node_id": 3, "req": None}),
    ],
)
def test_outside_a_lane_aware_cache_each_hook_is_upstreams_call(hook, args, kwargs) -> None:
    """Not a UnifiedRadixCache over the sharded allocator: upstream's function gets the
    very arguments and its result is returned, nothing else runs."""
    from sglang_cp_hicache.v0_5_23.eviction import lane_eviction

    calls = []

    def upstream(*a, **k):
        calls.append((a, k))
        return "upstream's result"

    assert getattr(lane_eviction, hook)(upstream, *args, **kwargs) == "upstream's result"
    assert calls == [(args, kwargs)]


@dataclass(eq=False)
class _Node:
    """A hand-built tree node for the planner alone (it reads ids, lanes and parents)."""

    id: int
    lanes: Tuple[int, ...]
    parent: Optional["_Node"] = None

    def __post_init__(self) -> None:
        self.children: List[_Node] = []
        if self.parent is not None:
            self.parent.children.append(self)


def test_enablers_the_plan_does_not_need_are_dropped() -> None:
    """Lane 0 is short and held only by inner node x: u and v (no lane-0 page) are planned
    as enablers, but only v, x's child, stays in the plan."""
    from sglang_cp_hicache.core.lane_eviction import plan_lane_victims

    root = _Node(0, (0, 0, 0))
    x = _Node(1, (1, 0, 0), root)
    u, v = _Node(2, (0, 1, 0), root), _Node(3, (0, 0, 1), x)

    def freed_parent(node, planned):
        parent = node.parent
        if parent is root or any(child not in planned for child in parent.children):
            return None
        return parent

    def plan(parent_of):
        return plan_lane_victims(
            iter([u, v]), [1, 0, 0], lambda n: n.lanes, freed_parent, lambda n: n.id,
            parent_of=parent_of,
        )  # fmt: skip

    assert plan(None) is None  # leaves alone cannot reach lane 0
    assert plan(lambda n: n.parent) == [v, x]


def test_a_new_chain_starts_where_its_draws_fit_when_the_freest_lane_does_not() -> None:
    """Free lanes [2, 2, 0, 1], a new 3-page chain. Upstream's base (the freest lane, 0)
    draws lanes 0, 1, 2 and lane 2 is empty; from lane 3 it draws 3, 0, 1, which fit.
    Where the freest lane fits, fit-first is upstream's rule; where nothing fits, too."""
    from sglang_cp_hicache.core.lane_eviction import extend_lane_demand

    def draws(free, pages, fit_first, base=None):
        return extend_lane_demand(free, [base], [0], [pages * PAGE], 4, PAGE, fit_first=fit_first)

    assert draws([2, 2, 0, 1], 3, fit_first=False) == ([1, 1, 1, 0], [0])
    assert draws([2, 2, 0, 1], 3, fit_first=True) == ([1, 1, 0, 1], [3])
    assert draws([2, 2, 1, 1], 3, fit_first=True) == draws([2, 2, 1, 1], 3, fit_first=False)
    # None fits: upstream's base.
    assert draws([0, 0, 0, 1], 3, fit_first=True) == ([1, 1, 0, 1], [3])
    # A continuing chain keeps its base: fit-first places new chains only.
    assert draws([2, 2, 0, 1], 3, fit_first=True, base=0) == ([1, 1, 1, 0], [0])
    # At its turn: the second new chain sees the first one's draws.
    demand, bases = extend_lane_demand(
        [1, 1, 1, 1], [None, None], [0, 0], [2 * PAGE, 2 * PAGE], 4, PAGE, fit_first=True
    )
    assert bases == [0, 2] and demand == [1, 1, 1, 1]


def test_an_old_ancestor_on_the_short_lane_goes_before_a_younger_leaf() -> None:
    """Lane 0 is short. The oldest leaf u (lane 1) hides its parent x (lane 0), older than
    the leaf y (lane 0): the LRU walk's order reaches x through u before y, so u and x go
    and y, the younger, stays (planning leaves alone would evict y)."""
    from sglang_cp_hicache.core.lane_eviction import plan_lane_victims

    root = _Node(0, (0, 0))
    x, y = _Node(1, (1, 0), root), _Node(3, (1, 0), root)
    u = _Node(2, (0, 1), x)
    age = {u: 1, x: 0, y: 2}  # x was last used before u (a parent never after its child)

    def freed_parent(node, planned):
        parent = node.parent
        if parent is root or any(child not in planned for child in parent.children):
            return None
        return parent

    def plan(parent_of):
        return plan_lane_victims(
            iter([u, y]), [1, 0], lambda n: n.lanes, freed_parent, age.__getitem__,
            parent_of=parent_of,
        )  # fmt: skip

    assert plan(lambda n: n.parent) == [u, x]
    assert plan(None) == [y]
