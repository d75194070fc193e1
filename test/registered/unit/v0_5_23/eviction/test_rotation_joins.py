"""Rotation-run joins on the real 0.5.23 sharded stack (cp 2, two gloo ranks).

Two requests of one extend batch start new chains over the same uncached prefix. Upstream
draws each new chain's rotation base from the least-full owner lane at its turn, so the
second request's chain starts on another lane than the first's; the first insert lands,
and the second is declined (its key would join two rotation runs,
``UnifiedTreeCore._rotation_conflict``): its own tail is never cached. Under the plugin's
flag the second chain takes the first one's base, so its insert joins that chain's run.

Each scenario runs through upstream's own ``alloc_paged_token_slots_extend`` with a real
``ScheduleBatch`` and ``Req`` objects, with the flag on and off in one process where the
plugin's hooks are applied; flag off is upstream's behaviour.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, replace
from typing import Dict, List, Sequence, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2
SHARED_PAGES = 2  # the uncached prefix both requests start with

# A batch: each request's (first token of its own tail, tail pages); every request starts
# with the same SHARED_PAGES pages. "unrelated" requests start with their own pages.
BATCHES: Dict[str, List[Tuple[int, int]]] = {
    "shared_prefix": [(5000, 1), (6000, 2)],
    "three_over_one_prefix": [(5000, 1), (6000, 2), (7000, 1)],
}
UNRELATED = [(5000, 3), (6000, 3)]


@dataclass(frozen=True)
class Outcome:
    """One batch, after every request's insert: equal on every rank but ``checked``
    (the owned rows this rank read back, summed over ranks by the fixture)."""

    bases: Tuple[int, ...]  # each request's rotation base, as the allocator drew it
    declined: Tuple[bool, ...]  # each insert's rotation_tail_declined
    matched: Tuple[int, ...]  # device prefix each request's tokens match afterwards
    mismatches: int  # owned KV rows of those matches that read back wrong
    checked: int
    free_pages_returned: bool  # after evicting everything, every lane's free pages are back


def _prompts(name: str) -> List[List[int]]:
    if name == "unrelated":
        return [list(range(first, first + pages * PAGE)) for first, pages in UNRELATED]
    shared = list(range(1000, 1000 + SHARED_PAGES * PAGE))
    return [shared + list(range(first, first + pages * PAGE)) for first, pages in BATCHES[name]]


def _alloc_batch(stack, prompts: Sequence[List[int]]) -> Tuple[List[torch.Tensor], List[int]]:
    """Upstream's extend allocation of one batch of new chains: each request's locs and
    the rotation base recorded on its ``Req`` (what its insert stamps on new nodes)."""
    from types import SimpleNamespace

    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend
    from sglang.srt.sampling.sampling_params import SamplingParams

    reqs = [
        Req(
            rid=f"r{i}",
            origin_input_text="",
            origin_input_ids=array("q", prompt),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1),
        )
        for i, prompt in enumerate(prompts)
    ]
    batch = ScheduleBatch(
        reqs=reqs,
        req_to_token_pool=stack.req_to_token_pool,
        token_to_kv_pool_allocator=stack.allocator,
        tree_cache=stack.cache,
        model_config=SimpleNamespace(is_encoder_decoder=False),
        device="cpu",
    )
    lens = [len(p) for p in prompts]
    zero, seq = torch.zeros(len(prompts), dtype=torch.int64), torch.tensor(lens)
    locs = alloc_paged_token_slots_extend(
        tree_cache=stack.cache, prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=seq,
        seq_lens_cpu=seq, last_loc=torch.full((len(prompts),), -1), extend_num_tokens=sum(lens),
        batch=batch,
    )  # fmt: skip
    per_request = list(torch.split(locs, lens))
    return per_request, [req.kv_rotation_base for req in reqs]


def _device_locs(stack, node_id) -> torch.Tensor:
    """The logical device locs of the tree path from the root to ``node_id``."""
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    core = stack.cache.tree_core
    node, values = core.node_by_id(node_id), []
    while node is not core.root_node:
        values.append(node.component_data[ComponentType.FULL].value)
        node = node.parent
    return torch.cat(values[::-1]) if values else torch.empty((0,), dtype=torch.int64)


def _run(ctx: RankContext, name: str, cp_shared_kv: bool) -> Outcome:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.sim.v0_5_23.checks import verify_hit, write_prefill_kv
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    config = StackConfig(device_pages_per_rank=8, host_to_device_ratio=4.0, cp_shared_kv=cp_shared_kv)
    with sharded_stack(ctx, config) as stack:
        free_start = tuple(stack.allocator.class_free_page_counts())
        prompts = _prompts(name)
        locs, bases = _alloc_batch(stack, prompts)
        for prompt, request_locs in zip(prompts, locs):  # the forward
            write_prefill_kv(stack, request_locs, torch.tensor(prompt), torch.arange(len(prompt)))
        declined = [
            bool(stack.insert(prompt, request_locs, base).rotation_tail_declined)
            for prompt, request_locs, base in zip(prompts, locs, bases)
        ]
        # A declined request keeps its own pages: its release frees them (upstream's
        # release_kv_cache past the protected prefix, which is 0 for a new chain).
        for was_declined, request_locs in zip(declined, locs):
            if was_declined:
                stack.allocator.free(request_locs)
        matched, mismatches, checked = [], 0, 0
        for prompt in prompts:
            match = stack.match(prompt)
            hit = _device_locs(stack, match.last_device_node)
            bad, owned = verify_hit(stack, hit, torch.tensor(prompt[: len(hit)]))
            matched.append(int(match.device_prefix_len))
            mismatches, checked = mismatches + bad, checked + owned
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()  # the backups' acks: every node is evictable
        stack.cache.evict(EvictParams(num_tokens=sum(len(p) for p in prompts)))
        return Outcome(
            bases=tuple(bases),
            declined=tuple(declined),
            matched=tuple(matched),
            mismatches=mismatches,
            checked=checked,
            free_pages_returned=tuple(stack.allocator.class_free_page_counts()) == free_start,
        )


def _rank(ctx: RankContext) -> Dict[Tuple[str, bool], Outcome]:
    names = [*BATCHES, "unrelated"]
    return {(name, flag): _run(ctx, name, flag) for name in names for flag in (True, False)}


@pytest.fixture(scope="module")
def outcomes() -> Dict[Tuple[str, bool], Outcome]:
    per_rank = run_ranks(LANES, _rank)
    replicated = [{k: replace(o, checked=0) for k, o in rank.items()} for rank in per_rank]
    assert replicated[0] == replicated[1], "the ranks placed or inserted differently"
    return {
        k: replace(o, checked=sum(rank[k].checked for rank in per_rank))
        for k, o in per_rank[0].items()
    }


def _whole_prompts_cached(name: str, outcome: Outcome) -> bool:
    wanted = tuple(len(p) // PAGE * PAGE for p in _prompts(name))
    return outcome.matched == wanted


@pytest.mark.parametrize("name", list(BATCHES))
def test_requests_of_one_batch_over_one_uncached_prefix_are_all_cached(outcomes, name) -> None:
    plugin = outcomes[(name, True)]
    assert not any(plugin.declined)
    assert len(set(plugin.bases)) == 1  # one chain: the first request's base
    assert _whole_prompts_cached(name, plugin)
    assert plugin.mismatches == 0 and plugin.checked > 0
    assert plugin.free_pages_returned


@pytest.mark.parametrize("name", list(BATCHES))
def test_upstream_declines_the_later_inserts(outcomes, name) -> None:
    """Upstream's least-full draw starts the second chain on the other lane: its insert is
    declined and only the shared prefix (the first request's pages) matches for it."""
    upstream = outcomes[(name, False)]
    assert upstream.bases[0] != upstream.bases[1]
    assert upstream.declined[0] is False and upstream.declined[1] is True
    assert upstream.matched[1] == SHARED_PAGES * PAGE
    assert not _whole_prompts_cached(name, upstream)
    assert upstream.mismatches == 0 and upstream.free_pages_returned


def test_new_chains_without_a_shared_first_page_are_placed_as_before(outcomes) -> None:
    """Unrelated new chains keep the fit-first placement: the second one starts on the
    lane the first one left freest, as upstream's draw does here."""
    plugin, upstream = outcomes[("unrelated", True)], outcomes[("unrelated", False)]
    assert plugin.bases == upstream.bases and plugin.bases[0] != plugin.bases[1]
    assert not any(plugin.declined) and _whole_prompts_cached("unrelated", plugin)
