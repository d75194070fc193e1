"""Device tokens in use under the flag (``v0_5_23/cache/pool_stats.py``): with owner lanes
uneven, the sharded allocator's admission floor (``available_size``) leaves free pages of
the other lanes out; the scheduler's stats (``/v1/loads``, ``sglang:num_used_tokens``) must
count only what is held, as upstream's own conservation check does. Real stack, cp 2."""

from __future__ import annotations

from typing import Dict, List

from sglang_cp_hicache.testing.dist import RankContext, run_ranks


def _observer(stack) -> object:
    from sglang.srt.managers.scheduler_components.pool_stats_observer import SchedulerPoolStatsObserver

    return SchedulerPoolStatsObserver(
        tree_cache=stack.cache,
        token_to_kv_pool_allocator=stack.allocator,
        req_to_token_pool=None,
        session_controller=None,
        hisparse_coordinator=None,
        is_hybrid_swa=False,
        is_hybrid_ssm=False,
        enable_hisparse=False,
        full_tokens_per_layer=None,
        swa_tokens_per_layer=None,
        max_total_num_tokens=stack.allocator.size,
    )


def _rank(ctx: RankContext) -> Dict[str, int]:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        observer = _observer(stack)
        page = stack.config.page_size
        idle = observer._get_token_info().full_num_used
        import torch

        held, _ = stack.alloc_extend(torch.empty(0, dtype=torch.int64), page)  # one lane: one page less
        stats = observer._get_token_info()
        report = {
            "page": page,
            "idle": idle,
            "held": stats.full_num_used,
            "usage_x_capacity": round(stats.full_token_usage * stack.allocator.size),
            "stranded": stack.allocator.aggregate_free_size() - stack.allocator.available_size(),
            "floor": stats.full_available_size - stack.allocator.available_size(),
        }
        stack.allocator.free(held)
        return report


def test_tokens_in_use_count_only_what_is_held_when_lanes_are_uneven() -> None:
    reports: List[Dict[str, int]] = run_ranks(2, _rank)
    for rank, r in enumerate(reports):
        assert r["stranded"] > 0, f"rank {rank}: lanes did not become uneven: {r}"  # the case is real
        assert r["idle"] == 0, f"rank {rank}: {r}"
        assert r["held"] == r["page"] == r["usage_x_capacity"], f"rank {rank}: {r}"
        assert r["floor"] == 0, f"rank {rank}: the admission floor must stay upstream's: {r}"
