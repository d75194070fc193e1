"""``testing.v0_5_23.stack.sharded_stack``, the multi-rank tests' one stack factory, closes
what it opens (cp 2, gloo ranks): on a normal exit and on an error inside, the stack is
closed (its cache's host resources released) and the server args it published are
replaced by the ones found at entry; the plugin's hooks are applied once per process."""

from __future__ import annotations

from typing import Dict, List

from sglang_cp_hicache.testing.dist import RankContext, run_ranks


class _Planted(RuntimeError):
    pass


def _rank(ctx: RankContext) -> Dict[str, object]:
    from sglang.srt.runtime_context import get_server_args
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.hooks import missing_hooks

    found = ServerArgs(model_path="dummy")  # compared by identity
    set_global_server_args_for_scheduler(found)
    report: Dict[str, object] = {}
    with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        report["published_inside"] = get_server_args() is stack.server_args
        report["hooks_inside"] = missing_hooks() == []
        first = stack
    report["closed"] = first._closed
    report["restored"] = get_server_args() is found
    try:
        with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
            second = stack
            raise _Planted("a failing test body")
    except _Planted:
        pass
    report["closed_on_error"] = second._closed
    report["restored_on_error"] = get_server_args() is found
    return report


def test_the_factory_closes_the_stack_and_restores_the_context_also_on_error() -> None:
    reports: List[Dict[str, object]] = run_ranks(2, _rank)
    for rank, report in enumerate(reports):
        assert all(report.values()), f"rank {rank}: {report}"
