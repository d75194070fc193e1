"""The plugin's own Prometheus series move with what the plugin decides, on the REAL 0.5.23
sharded stack (cp 2, gloo ranks, the plugin's flag and hooks, ``--enable-metrics``), and
exist only with ``--enable-metrics`` and only on a sharded cache.

Each rank, one cache per process (one registry):
* three requests of one extend batch start new chains over one first page: the later two
  are kept on the first's rotation run (``inserts_kept_on_run_total``);
* chains of known owner lanes fill the device (4 pages a lane) while the host holds 3 a
  lane, so their write-through backups need host room (plans, or backups skipped); then a
  device eviction one lane short (``evict_for_alloc``, a device plan on that lane);
* upstream's stats tick (``SchedulerMetricsReporter._log_hicache_stats``, upstream's own
  method) publishes the free pages per owner lane and tier.
The series must equal the extension's own replicated counts, path by path, and be the
same on both ranks but for the rank labels.
"""

from __future__ import annotations

from array import array
from types import SimpleNamespace
from typing import Dict, List, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2
PREFIX = "sglang:cp_hicache_"
# (rotation base, pages): free device lanes [1, 0] after them (one_lane of test_lane_eviction)
CHAINS: Tuple[Tuple[int, int], ...] = ((0, 1), (1, 1), (1, 1), (1, 2), (0, 2))


def _scrape() -> Tuple[Tuple[str, Tuple[Tuple[str, str], ...], float], ...]:
    """This process's plugin samples (one cache per process) from the default registry."""
    from prometheus_client import REGISTRY, generate_latest

    from sglang_cp_hicache.testing.server.metrics import Metrics

    samples = Metrics.parse(generate_latest(REGISTRY).decode()).samples
    return tuple(s for s in samples if s[0].startswith(PREFIX) and not s[0].endswith("_created"))


def _tick(stack) -> None:
    """Upstream's stats tick for this stack's cache (the reporter built without its
    ``__post_init__``: the method reads only ``scheduler`` and ``stats``)."""
    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.observability.metrics_collector import SchedulerStats

    reporter = object.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(enable_hierarchical_cache=True, tree_cache=stack.cache)
    reporter.stats = SchedulerStats()
    reporter._log_hicache_stats()


def _join_batch(stack) -> None:
    """One extend batch of three new chains sharing their first page (one chain started,
    two kept on its run), allocated through
    upstream's ``alloc_paged_token_slots_extend`` (real Req, ScheduleBatch), then freed."""
    from sglang.srt.managers.schedule_batch import Req, ScheduleBatch
    from sglang.srt.mem_cache.allocation import alloc_paged_token_slots_extend
    from sglang.srt.sampling.sampling_params import SamplingParams

    shared = list(range(1000, 1000 + PAGE))
    prompts = [shared + list(range(first, first + PAGE)) for first in (5000, 6000, 7000)]
    reqs = [
        Req(rid=f"r{i}", origin_input_text="", origin_input_ids=array("q", p),
            sampling_params=SamplingParams(temperature=0, max_new_tokens=1))
        for i, p in enumerate(prompts)
    ]  # fmt: skip
    batch = ScheduleBatch(
        reqs=reqs, req_to_token_pool=stack.req_to_token_pool, token_to_kv_pool_allocator=stack.allocator,
        tree_cache=stack.cache, model_config=SimpleNamespace(is_encoder_decoder=False), device="cpu",
    )  # fmt: skip
    lens = [len(p) for p in prompts]
    zero, seq = torch.zeros(len(lens), dtype=torch.int64), torch.tensor(lens)
    locs = alloc_paged_token_slots_extend(
        tree_cache=stack.cache, prefix_lens=zero, prefix_lens_cpu=zero, seq_lens=seq,
        seq_lens_cpu=seq, last_loc=torch.full((len(lens),), -1), extend_num_tokens=sum(lens), batch=batch,
    )  # fmt: skip
    stack.allocator.free(locs)


def _insert(stack, index: int, base: int, pages: int) -> List[int]:
    empty = torch.empty((0,), dtype=torch.int64)
    tokens = list(range(10_000 * (index + 1), 10_000 * (index + 1) + pages * PAGE))
    locs, rotation_base = stack.alloc_extend(empty, len(tokens), base if stack.sharded else None)
    stack.insert(tokens, locs, rotation_base)
    stack.cache.flush_pending_backups()
    stack.cache.writing_check()
    return tokens


def _fill_and_evict(stack) -> None:
    """The device filled, then evicted one lane short (a device plan); everything demoted
    to host and more chains backed up (host room made); every host chain host-locked and
    one more backed up (no room: the backup skipped)."""
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    chains = [_insert(stack, index, base, pages) for index, (base, pages) in enumerate(CHAINS)]
    stack.cache.evict_for_alloc(EvictParams(num_tokens=2 * PAGE - stack.device_available()))
    everything = EvictParams(num_tokens=LANES * stack.allocator.size)
    for index in range(len(CHAINS), len(CHAINS) + 3):
        stack.cache.evict(everything)
        chains.append(_insert(stack, index, index % LANES, 2))
    stack.cache.evict(everything)
    for tokens in chains:
        match = stack.match(tokens)
        if match.device_prefix_len == 0 and match.host_hit_length > 0:
            stack.cache.inc_host_lock_ref(match.last_host_node)
    _insert(stack, 99, 0, 3)


def _stats(extension) -> Dict[str, Dict[str, Tuple[int, int, int]]]:
    """The extension's own counts: per tier, per path (plans, pages freed, refusals)."""
    return {
        tier: {p: (s.plans, s.evicted_tokens // PAGE, s.refusals) for p, s in stats.paths.items()}
        for tier, stats in (("device", extension.device_stats), ("host", extension.host_stats))
    }


def metered_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import stamp_parallel
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    stamp_parallel(ctx.world_size, ctx.rank, ctx.cp_group, ctx.attn_tp_group)  # rank labels
    config = StackConfig(device_pages_per_rank=4, host_to_device_ratio=1.0, cp_shared_kv=True, enable_metrics=True)
    with sharded_stack(ctx, config) as stack:
        _tick(stack)
        idle = _scrape()
        _join_batch(stack)
        _fill_and_evict(stack)
        _tick(stack)
        lanes = {
            "device": tuple(stack.allocator.class_free_page_counts()),
            "host": tuple(stack.kv_host_pool._slots.class_free_page_counts()),
        }
        return {"idle": idle, "after": _scrape(), "stats": _stats(extension_of(stack.cache)), "lanes": lanes}


def unmetered_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of
    from sglang_cp_hicache.v0_5_23.cache.plugin_metrics import NO_METRICS

    config = StackConfig(device_pages_per_rank=4, host_to_device_ratio=1.0, cp_shared_kv=True)
    with sharded_stack(ctx, config) as stack:
        _join_batch(stack)
        _fill_and_evict(stack)
        _tick(stack)
        extension = extension_of(stack.cache)
        return {"samples": _scrape(), "no_metrics": extension.metrics is NO_METRICS, "stats": _stats(extension)}


def unsharded_rank(ctx: RankContext) -> Dict[str, object]:
    from prometheus_client import REGISTRY, generate_latest

    from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import stamp_parallel
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_unsharded_stack

    stamp_parallel(1, 0, ctx.cp_group, ctx.attn_tp_group)
    config = StackConfig(device_pages_per_rank=32, enable_metrics=True)
    with build_unsharded_stack(ctx.attn_tp_group, config) as stack:
        _fill_and_evict(stack)
        _tick(stack)
        upstream = "sglang:evicted_tokens_total" in generate_latest(REGISTRY).decode()
        return {"samples": _scrape(), "upstream_series": upstream}


@pytest.fixture(scope="module")
def metered() -> List[Dict[str, object]]:
    return run_ranks(LANES, metered_rank)


def _value(samples, name: str, **labels: str) -> float:
    return sum(v for n, l, v in samples if n == PREFIX + name and labels.items() <= dict(l).items())


def _without_rank(samples) -> List[tuple]:
    return sorted((n, tuple(kv for kv in l if kv[0] not in ("tp_rank", "attn_cp_rank")), v) for n, l, v in samples)


def test_every_series_carries_the_rank_labels(metered) -> None:
    for rank, report in enumerate(metered):
        for name, labels, _ in report["after"]:
            labels = dict(labels)
            assert labels["tp_rank"] == labels["attn_cp_rank"] == str(rank), (name, labels)


def test_logical_series_are_equal_on_both_ranks(metered) -> None:
    logical = [[s for s in r["after"] if "layer_backup" not in s[0] and "_l3_" not in s[0]] for r in metered]
    assert _without_rank(logical[0]) == _without_rank(logical[1])


def test_free_pages_per_lane_and_tier_are_the_allocators_at_the_tick(metered) -> None:
    for report in metered:
        for tier in ("device", "host"):
            published = tuple(_value(report["after"], "free_pages", tier=tier, lane=str(lane)) for lane in range(LANES))
            assert published == report["lanes"][tier], (tier, report["lanes"])
            idle = tuple(_value(report["idle"], "free_pages", tier=tier, lane=str(lane)) for lane in range(LANES))
            assert idle != published, f"{tier}: the fill moved no lane"


def test_eviction_plans_pages_and_refusals_equal_the_extensions_counts(metered) -> None:
    refusals = {"device": "device_room_refusals", "host": "backups_skipped"}
    for report in metered:
        for tier, paths in report["stats"].items():
            for path, (plans, pages, refused) in paths.items():
                assert _value(report["after"], "lane_eviction_plans_total", tier=tier, path=path) == plans
                assert _value(report["after"], "lane_evicted_pages_total", tier=tier, path=path) == pages
                assert _value(report["after"], f"{refusals[tier]}_total", path=path) == refused, (tier, path)
    stats = metered[0]["stats"]
    assert stats["device"]["floor"][0] >= 1, stats  # the scenario planned on device
    assert sum(p[0] for p in stats["host"].values()) >= 1, stats  # and made host room
    assert stats["host"]["backup"][2] >= 1, stats  # and skipped a backup


def test_new_chains_kept_on_a_batch_mate_s_run_are_counted(metered) -> None:
    for report in metered:
        assert _value(report["idle"], "inserts_kept_on_run_total") == 0
        assert _value(report["after"], "inserts_kept_on_run_total") == 2  # one chain started


def test_without_enable_metrics_no_plugin_series_exists() -> None:
    for report in run_ranks(LANES, unmetered_rank):
        assert report["no_metrics"] and report["samples"] == ()
        assert report["stats"]["host"]["backup"][2] >= 1  # the same decisions were made


def test_an_unsharded_cache_publishes_upstream_s_series_and_none_of_the_plugin_s() -> None:
    (report,) = run_ranks(1, unsharded_rank)
    assert report["upstream_series"] and report["samples"] == ()
