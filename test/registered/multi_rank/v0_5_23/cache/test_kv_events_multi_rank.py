"""KV events of a sharded group against its unsharded reference, on the real 0.5.23 stacks.

The same logical work (two requests sharing a prefix, their write-through backups, the
device evicted, one loaded back, everything evicted) on a cp 2 group with the plugin's flag
and on one unsharded rank, each with the KV event recorder where the scheduler turns it on
(the group: CP rank 0 only). The group publishes one stream, rank 0's, and its
``BlockStored`` / ``BlockRemoved`` sequence on ``GPU`` and ``CPU_PINNED`` (block hashes,
parent links, tokens, medium, one entry per block: batches and coalesced events split) is
the reference's, step by step. Rank 1 records nothing.
"""

from __future__ import annotations

import time
from typing import Any, Dict, List, Tuple

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
FIRST = list(range(1, 3 * PAGE + 1))
SECOND = FIRST[: 2 * PAGE] + list(range(40_001, 40_001 + 2 * PAGE))
REQUESTS: List[Tuple[List[int], int]] = [(FIRST, 0), (SECOND, 2 * PAGE)]  # (tokens, shared)
STEPS = ("inserted", "backed_up", "device_evicted", "loaded_back", "all_evicted")


def _events(stack: Any) -> List[tuple]:
    """The cache's queued events as one plain tuple per block (picklable, comparable)."""
    import msgspec

    from sglang_cp_hicache.testing.kv_events import block_events

    return [tuple(vars(e).values()) for e in block_events(msgspec.to_builtins(e) for e in stack.cache.take_events())]


def _prefix(stack: Any, tokens: List[int], shared: int):
    import torch

    if not shared:
        return torch.empty((0,), dtype=torch.int64), None
    match = stack.match(tokens[:shared])
    return stack.cache.path_device_indices(match.last_device_node), stack.cache.rotation_base_of(match.last_device_node)


def _backed_up(stack: Any) -> None:
    from sglang_cp_hicache.testing.v0_5_23.storage import WAIT_STEP_S, WAIT_STEPS, _all_ranks

    stack.cache.flush_pending_backups()
    for _ in range(WAIT_STEPS):
        stack.cache.writing_check()
        if _all_ranks(stack, not stack.cache.ongoing_write_through):
            return
        time.sleep(WAIT_STEP_S)
    raise TimeoutError(f"rank {stack.shard_rank}: write-through never acked")


def workload(stack: Any) -> Dict[str, List[tuple]]:
    """The logical work, step by step; each step's events."""
    import torch
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.storage import load_back

    stack.cache.take_events()  # the cache's start (AllBlocksCleared)
    steps: Dict[str, List[tuple]] = {}
    for tokens, shared in REQUESTS:
        prefix, base = _prefix(stack, tokens, shared)
        locs, base = stack.alloc_extend(prefix, len(tokens), base)
        stack.insert(tokens, torch.cat([prefix, locs]), base, cached_len=shared)
    steps["inserted"] = _events(stack)
    _backed_up(stack)
    steps["backed_up"] = _events(stack)
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    steps["device_evicted"] = _events(stack)
    load_back(stack, FIRST)
    steps["loaded_back"] = _events(stack)
    stack.cache.evict(EvictParams(num_tokens=stack.allocator.size))
    stack.cache.evict_host(stack.kv_host_pool.logical_size)
    steps["all_evicted"] = _events(stack)
    return steps


def sharded_run(ctx: RankContext) -> Dict[str, List[tuple]]:
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, sharded_stack

    with sharded_stack(ctx, StackConfig(cp_shared_kv=True, kv_events=True)) as stack:
        return workload(stack)


def reference_run(ctx: RankContext) -> Dict[str, List[tuple]]:
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, apply_plugin_hooks, build_unsharded_stack

    apply_plugin_hooks()
    with build_unsharded_stack(ctx.attn_tp_group, StackConfig(kv_events=True)) as stack:
        return workload(stack)


@pytest.fixture(scope="module")
def streams() -> Tuple[List[Dict[str, List[tuple]]], Dict[str, List[tuple]]]:
    return run_ranks(2, sharded_run), run_ranks(1, reference_run)[0]


def test_the_sharded_group_publishes_the_reference_s_stream_step_by_step(streams):
    (publisher, _), reference = streams
    for step in STEPS:
        assert publisher[step] == reference[step], step
    kinds = {(e[0], e[1]) for step in STEPS for e in reference[step]}
    assert kinds == {("stored", "GPU"), ("stored", "CPU_PINNED"), ("removed", "GPU"), ("removed", "CPU_PINNED")}


def test_every_page_of_the_work_is_named(streams):
    _, reference = streams
    stored = [e for e in reference["inserted"] if e[0] == "stored"]
    assert len(stored) == (len(FIRST) + len(SECOND) - 2 * PAGE) // PAGE
    assert [e[4] for e in stored[:3]] == [tuple(FIRST[i * PAGE : (i + 1) * PAGE]) for i in range(3)]


def test_only_cp_rank_0_records(streams):
    (_, other), _ = streams
    assert other == {step: [] for step in STEPS}
