"""Upstream's host-tier gauges (``sglang:hicache_host_used_tokens`` / ``_total_tokens``,
filled by ``SchedulerMetricsReporter._log_hicache_stats``) are logical and exact under the
flag, however uneven the owner lanes: the REAL 0.5.23 sharded stack (cp 2, gloo ranks, the
plugin's hooks applied) beside its unsharded reference, the same chains backed up.

Upstream reads ``logical_size - available_size()``, and a sharded host pool's
``available_size`` is the tightest lane's free pages x the shard size (an admission floor),
so it counts every lane as full as the fullest one, and each rank's reserved local page 0
as used. The reporter is upstream's own class and method, built without its
``__post_init__`` (that needs a whole scheduler): the method reads only ``scheduler`` and
``stats``.
"""

from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
# (first token, pages, rotation base): host lanes used [3, 2] after A, [4, 2] after B.
CHAINS: Tuple[Tuple[int, int, int], ...] = ((1, 5, 0), (20_001, 1, 0))


def _host_gauges(stack) -> Tuple[int, int]:
    """(used, total) as upstream's reporter publishes them for this stack's cache."""
    from types import SimpleNamespace

    from sglang.srt.managers.scheduler_components.metrics_reporter import SchedulerMetricsReporter
    from sglang.srt.observability.metrics_collector import SchedulerStats

    reporter = object.__new__(SchedulerMetricsReporter)
    reporter.scheduler = SimpleNamespace(enable_hierarchical_cache=True, tree_cache=stack.cache)
    reporter.stats = SchedulerStats()
    reporter._log_hicache_stats()
    return reporter.stats.hicache_host_used_tokens, reporter.stats.hicache_host_total_tokens


def _back_up(stack) -> Dict[str, object]:
    """The gauges idle, then after each chain is inserted and its write-through acked."""
    empty = torch.empty((0,), dtype=torch.int64)
    readings: List[Tuple[int, int]] = [_host_gauges(stack)]
    for first, pages, base in CHAINS:
        tokens = list(range(first, first + pages * PAGE))
        locs, rotation_base = stack.alloc_extend(empty, len(tokens), base if stack.sharded else None)
        stack.insert(tokens, locs, rotation_base)
        stack.cache.flush_pending_backups()
        stack.cache.writing_check()
        readings.append(_host_gauges(stack))
    report: Dict[str, object] = {"readings": readings, "host_rows": stack.kv_host_pool.size}
    if stack.sharded:
        report["lanes_free"] = tuple(stack.kv_host_pool._slots.class_free_page_counts())
    return report


def sharded_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        return _back_up(stack)


def reference_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    with build_unsharded_stack(ctx.attn_tp_group, StackConfig(device_pages_per_rank=32)) as stack:
        return _back_up(stack)


@pytest.fixture(scope="module")
def sharded() -> List[Dict[str, object]]:
    return run_ranks(2, sharded_rank)


@pytest.fixture(scope="module")
def reference() -> Dict[str, object]:
    return run_ranks(1, reference_rank)[0]


def test_the_lanes_are_uneven(sharded) -> None:
    for report in sharded:
        free = report["lanes_free"]
        assert free[0] != free[1], report  # the scenario is the one the issue names


def test_used_tokens_are_the_logical_tokens_on_host_as_the_reference_counts_them(sharded, reference) -> None:
    used_reference = [used for used, _ in reference["readings"]]
    assert used_reference == [0, 5 * PAGE, 6 * PAGE], reference
    for rank, report in enumerate(sharded):
        used = [used for used, _ in report["readings"]]
        assert used == used_reference, f"rank {rank}: {report}"


def test_total_tokens_are_the_logical_host_capacity_and_used_plus_free_adds_up(sharded) -> None:
    for rank, report in enumerate(sharded):
        # each rank's host rows but its reserved page 0, over both ranks
        capacity = 2 * (report["host_rows"] - PAGE)
        free = PAGE * sum(report["lanes_free"])
        used, total = report["readings"][-1]
        assert {total for _, total in report["readings"]} == {capacity}, f"rank {rank}: {report}"
        assert used + free == total, f"rank {rank}: {report}"
