"""Lane-aware host eviction keeps every rank identical (cp 2, the real 0.5.23 stack).

Each gloo rank replays the same seeded churn on its own sharded stack under the plugin's
flag: new chains at both rotation bases and extensions of chains the host holds (so host
nodes gain children and inner host nodes are reached through them), each step demoting
the device to host first, so every backup needs host room, and a few host chains
host-locked at a time (as a load-back locks its host nodes), so some deficits cannot be
covered. After every step the ranks' tree snapshots (logical keys, locs, flags, rotation bases), logical host lane free counts
and host-eviction counts must be equal; host eviction must have planned, fitted and
refused. A flush at the end gives back every host page.
"""

from __future__ import annotations

import hashlib
import random
from array import array
from typing import Any, List, Tuple

import torch

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LANES = 2
STEPS = 30
MAX_HOST_LOCKS = 6


def _digest(stack) -> str:
    return hashlib.sha256(repr(stack.tree_snapshot()).encode()).hexdigest()


def _host_node(stack, tokens: List[int]) -> Any:
    """The last node of ``tokens`` if the host holds all of them and the device none."""
    from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    match = stack.cache.match_prefix(MatchPrefixParams(key=RadixKey(array("q", tokens))))
    if match.device_prefix_len == 0 and match.host_hit_length == len(tokens):
        return match.last_host_node
    return None


def _churn(ctx: RankContext) -> Tuple[List[Tuple[str, Tuple[int, ...], Tuple[int, ...]]], Any]:
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    config = StackConfig(device_pages_per_rank=6, host_to_device_ratio=1.0, cp_shared_kv=True)
    rng, trace = random.Random(20261202), []
    chains: List[Tuple[List[int], int]] = []  # (tokens, rotation base) of every insert
    locks: List[Tuple[Any, Any]] = []  # (host node, its lock's release params)
    with sharded_stack(ctx, config) as stack:
        slots = stack.kv_host_pool._slots
        host_start = slots.class_free_page_counts()
        for step in range(STEPS):
            stack.cache.evict(EvictParams(num_tokens=2 * LANES * config.device_rows_per_rank))
            held = [(c, _host_node(stack, c[0])) for c in chains]
            held = [(c, node) for c, node in held if node is not None]
            if held and rng.random() < 0.7:
                node = rng.choice(held)[1]
                locks.append((node, stack.cache.inc_host_lock_ref(node).to_dec_params()))
            if len(locks) > MAX_HOST_LOCKS:
                stack.cache.dec_host_lock_ref(*locks.pop(0))
            parents = [c for c, _ in held if len(c[0]) <= 3 * PAGE]
            new_tokens = list(range(10_000 * (step + 1), 10_000 * (step + 1) + rng.randint(1, 3) * PAGE))
            if parents and rng.random() < 0.5:  # extend a chain the host holds
                prefix, base = rng.choice(parents)
                tokens = prefix[: rng.randint(1, len(prefix) // PAGE) * PAGE] + new_tokens
            else:
                tokens, base = new_tokens, rng.randrange(LANES)
            empty = torch.empty((0,), dtype=torch.int64)
            locs, base = stack.alloc_extend(empty, len(tokens), rotation_base=base)
            stack.insert(tokens, locs, base)
            stack.cache.flush_pending_backups()
            stack.cache.writing_check()
            chains.append((tokens, base))
            host = extension_of(stack.cache).host_stats
            names = ("short", "fit", "plans", "refusals", "victims", "evicted_tokens")
            stats = tuple(host.total(name) for name in names)
            trace.append((_digest(stack), tuple(slots.class_free_page_counts()), stats))
        for lock in locks:
            stack.cache.dec_host_lock_ref(*lock)
        stack.cache.evict(EvictParams(num_tokens=2 * LANES * config.device_rows_per_rank))
        stack.cache.evict_host(stack.kv_host_pool.logical_size)
        flushed = (tuple(host_start), tuple(slots.class_free_page_counts()))
    return trace, flushed


def test_ranks_stay_identical_under_lane_aware_host_eviction() -> None:
    per_rank = run_ranks(LANES, _churn)
    (trace0, flushed0), (trace1, flushed1) = per_rank
    for step, (a, b) in enumerate(zip(trace0, trace1)):
        assert a == b, f"step {step}: rank 0 {a} != rank 1 {b}"
    short, fit, plans, refusals, victims, evicted = trace0[-1][2]
    assert plans > 0 and fit > 0 and refusals > 0 and victims >= plans and evicted > 0, trace0[-1][2]
    assert short == fit + plans + refusals
    # Nothing lost: the flush gives every host page back, on both ranks.
    assert flushed0 == flushed1 and flushed0[0] == flushed0[1]
