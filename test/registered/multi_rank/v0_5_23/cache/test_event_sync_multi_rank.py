"""The event check's MIN all-reduce is skipped by every rank together, never by one alone
(``v0_5_23/cache/event_sync.py``), on the REAL 0.5.23 sharded stack across two gloo ranks.

A backup's ack lands on rank 0 at once and on rank 1 only when the test releases it (its
copy's event held in flight, as a slower device would): the checks while it is pending must
reduce on both ranks (each MIN gives 0 until both are ready), the idle checks before and
after must skip on both, and every rank must see the same pending count after every check.
A rank that skipped while the other reduced would leave its peer alone in the all-reduce:
the cache's group here times out after :data:`GROUP_TIMEOUT_S`, so a divergence fails the
test within a bound instead of hanging it, and a decision planted from rank-local state
(this rank's ready acks) is shown to fail.
"""

from __future__ import annotations

import datetime
import time
from typing import Dict, List, Tuple

import pytest

from sglang_cp_hicache.testing.dist import RankContext, RankFailed, run_ranks

PAGE = 64
GROUP_TIMEOUT_S = 30  # the cache's CP group: a rank left alone in a collective fails within it
RUN_TIMEOUT_S = 240
SLOW_RANK = 1  # its backup's ack lands only when released

# One check: (pending writes before, all-reduces it ran, pending writes after).
Check = Tuple[int, int, int]


def _rank_local_decision(cache) -> bool:
    """A planted mistake: skip when this rank has no ack ready (rank-local state)."""
    return cache._count_ready_acks(cache.cache_controller.ack_write_queue) == 0


def _checks(ctx: RankContext, plant: bool) -> Dict[str, List[Check]]:
    import torch
    import torch.distributed as dist

    from sglang_cp_hicache.testing import device_module
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache import event_sync

    group = dist.new_group(
        list(range(ctx.world_size)), backend="gloo",
        timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
    )  # fmt: skip
    bounded = RankContext(ctx.rank, ctx.world_size, group, ctx.attn_tp_group)
    if plant:
        event_sync.nothing_in_flight = _rank_local_decision
    record: Dict[str, List[Check]] = {"idle_before": [], "pending": [], "idle_after": []}
    dist.barrier(group=ctx.cp_group)  # the set-up's own lag (a loaded box) is not a check's
    with sharded_stack(bounded, StackConfig(layer_num=1, cp_shared_kv=True)) as stack:
        cache = stack.cache
        reduces = [0]
        all_reduce = cache._all_reduce

        def counted(*args, **kwargs):
            reduces[0] += 1
            return all_reduce(*args, **kwargs)

        cache._all_reduce = counted
        dist.barrier(group=ctx.cp_group)

        def check(phase: str) -> None:
            before, reduces[0] = len(cache.ongoing_write_through), 0
            cache.check_hicache_events()
            record[phase].append((before, reduces[0], len(cache.ongoing_write_through)))

        for _ in range(2):
            check("idle_before")
        locs, base = stack.alloc_extend(torch.empty(0, dtype=torch.int64), 2 * PAGE)
        stack.insert(list(range(1, 2 * PAGE + 1)), locs, base)
        assert cache.ongoing_write_through, "the insert queued no write-through backup"
        hold = device_module().hold_events() if ctx.rank == SLOW_RANK else None
        for _ in range(3):  # the slow rank's copy is still in flight
            check("pending")
        if hold is not None:
            hold.release()
        check("pending")  # both acks ready now
        for _ in range(2):
            check("idle_after")
    return record


def _run(plant: bool) -> List[Dict[str, List[Check]]]:
    return run_ranks(2, _checks, plant, timeout_s=RUN_TIMEOUT_S)


def test_ranks_skip_the_idle_all_reduce_together_and_reduce_while_a_write_is_pending():
    records = _run(plant=False)
    assert records[0] == records[1]  # every check: the same branch, the same pending count
    record = records[0]
    assert record["idle_before"] == [(0, 0, 0)] * 2
    assert record["pending"] == [(1, 1, 1)] * 3 + [(1, 1, 0)]
    assert record["idle_after"] == [(0, 0, 0)] * 2


def test_a_rank_local_skip_decision_fails_within_the_bound():
    """The plant skips on the slow rank while the other reduces: the run ends in a gloo
    timeout or in differing records, never in a hang."""
    start = time.monotonic()
    try:
        records = _run(plant=True)
    except RankFailed:
        diverged = True
    else:
        diverged = records[0] != records[1]
    assert diverged
    assert time.monotonic() - start < RUN_TIMEOUT_S
