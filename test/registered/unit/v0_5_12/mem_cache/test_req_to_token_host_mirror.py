"""Node runs from host state on the scheduler path: no device value is read back.

SGLang's own ``alloc_for_extend`` / ``alloc_for_decode`` (with the plugin's hooks), real
``Req``s, chunked prefill with ``cache_unfinished_req`` (also de-duplicating against a
request of the same batch), decode across page boundaries, ``release_kv_cache``,
load-back of split host nodes, write-through backups and device eviction, on one rank of a
CP-2 stack. After every scheduler step: each live request's host mirror row equals its
``req_to_token`` row, and every device node's run equals its device value.
"""

from __future__ import annotations

from typing import List

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import (
    InitLoadBackParams,
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import ReqToTokenHostMirror
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack, scheduler_batch

PS = 64
CHUNK = 2 * PS + 17  # chunk ends inside a page: the tail continues the partial page
DECODE = PS + 5  # decode crosses a page boundary


@pytest.fixture
def stack(gloo_world1, plugins_loaded):
    cfg = nsa_stack.StackConfig(
        cp_size=2, physical_tokens=PS * 12, req_pool_size=8, max_context_len=16 * PS
    )
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    assert isinstance(stack.cache, CpHiRadixCache) and stack.cache.req_loc_mirror is not None
    with scheduler_batch.cpu_scheduler_server_args(PS):
        yield stack
    stack.close()


class Spy:
    """Counts calls of a cache method (the method still runs)."""

    def __init__(self, monkeypatch, obj, name: str) -> None:
        self.calls = 0
        real = getattr(obj, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(obj, name, counted)


def _check(stack, live: List[Req]) -> None:
    mirror: ReqToTokenHostMirror = stack.cache.req_loc_mirror
    for req in live:
        n = req.kv_allocated_len
        expected = stack.req_to_token_pool.req_to_token[req.req_pool_idx, :n].numpy()
        assert np.array_equal(mirror.row(req.req_pool_idx)[:n], expected), req.rid
    assert nsa_stack.device_run_mismatches(stack.cache) == []


def _admit(stack, req: Req) -> int:
    """Scheduler match, then PrefillAdder's load-back and lock; loaded tokens."""
    cache = stack.cache
    req.init_next_round_input(cache)
    loaded = 0
    if req.host_hit_length > 0:
        new_indices, req.last_node = cache.init_load_back(
            InitLoadBackParams(
                best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req
            )
        )
        loaded = len(new_indices)
        req.prefix_indices = torch.cat([req.prefix_indices, new_indices])
        req.cache_protected_len = len(req.prefix_indices)
    cache.inc_lock_ref(req.last_node)
    return loaded


def _run_batch(stack, reqs: List[Req]) -> int:
    """One batch from admission to release: chunked prefill, decode, finish."""
    cache = stack.cache
    loaded = sum(_admit(stack, req) for req in reqs)
    cache.ready_to_load_host_cache()
    active = list(reqs)
    while active:  # prefill chunks
        seq_lens = [min(len(r.origin_input_ids), len(r.prefix_indices) + CHUNK) for r in active]
        for req, n in zip(active, seq_lens):
            req.fill_ids = req.origin_input_ids[:n]
        scheduler_batch.alloc_for_extend(stack, active, seq_lens)
        for req, n in zip(active, seq_lens):
            req.kv_committed_len = req.kv_allocated_len = n
        _check(stack, reqs)
        for req, n in zip(active, seq_lens):
            chunked = n < len(req.origin_input_ids)
            req.is_chunked = int(chunked)
            cache.cache_unfinished_req(req, chunked=chunked)
        _check(stack, reqs)
        active = [r for r, n in zip(active, seq_lens) if n < len(r.origin_input_ids)]
    for step in range(DECODE):
        for req in reqs:
            req.output_ids.append(50000 + step)
        seq_lens = [req.kv_allocated_len for req in reqs]
        scheduler_batch.alloc_for_decode(stack, reqs, seq_lens)
        for req in reqs:
            req.kv_committed_len += 1
            req.kv_allocated_len += 1
    _check(stack, reqs)
    for req in reqs:
        release_kv_cache(req, cache)
    cache.check_hicache_events()
    _check(stack, [])
    return loaded


def _prompt(prefix: int, tail: int, length: int) -> List[int]:
    shared = [prefix * 1000 + i for i in range(3 * PS)]
    return shared + [tail * 100000 + i for i in range(length)]


def test_scheduler_path_reads_no_device_value(stack, monkeypatch):
    cache = stack.cache
    evictions = Spy(monkeypatch, cache, "_evict_device_node")
    backups = Spy(monkeypatch, cache, "write_backup")
    splits = Spy(monkeypatch, cache, "_split_node")
    loaded = 0
    for batch in range(12):
        prefix = batch % 3
        # Same batch, same prefix: the second request's chunk re-match de-duplicates the
        # positions the first one inserted first.
        reqs = [
            Req(
                rid=f"b{batch}r{i}",
                origin_input_text="",
                origin_input_ids=_prompt(prefix, 10 * batch + i, PS + 40 * (i + 1)),
                sampling_params=SamplingParams(max_new_tokens=DECODE),
            )
            for i in range(2)
        ]
        loaded += _run_batch(stack, reqs)
    assert cache.device_value_reads == 0
    # The paths this test pins were all taken.
    assert loaded > 0 and evictions.calls > 0 and backups.calls > 0 and splits.calls > 0


def _req(rid: str, ids: List[int]) -> Req:
    return Req(
        rid=rid,
        origin_input_text="",
        origin_input_ids=ids,
        sampling_params=SamplingParams(max_new_tokens=DECODE),
    )


def test_split_of_a_planned_node_splits_its_host_locs(stack):
    first = list(range(1, 1 + 5 * PS))
    _run_batch(stack, [_req("first", first)])
    # The second chunk's node (pages 2..3); its backup was planned from its run.
    key = nsa_stack.radix_key(first[: 4 * PS])
    node = stack.cache.match_prefix(MatchPrefixParams(key=key)).last_device_node
    assert node.cp_device_run is not None and len(node.key) == 2 * PS
    _run_batch(stack, [_req("second", first[: 3 * PS] + [7] * PS)])  # splits that node
    assert len(node.key) == PS and stack.cache.device_value_reads == 0


def test_retracted_request_is_mirrored_again_in_a_new_slot(stack):
    cache = stack.cache
    req = _req("retracted", list(range(1, 1 + 3 * PS + 9)))
    _admit(stack, req)
    n = len(req.origin_input_ids)
    scheduler_batch.alloc_for_extend(stack, [req], [n])
    req.kv_committed_len = req.kv_allocated_len = n
    cache.cache_unfinished_req(req)
    for step in range(PS):  # decode into a new page, then retract
        req.output_ids.append(60000 + step)
        scheduler_batch.alloc_for_decode(stack, [req], [req.kv_allocated_len])
        req.kv_committed_len += 1
        req.kv_allocated_len += 1
    _check(stack, [req])
    release_kv_cache(req, cache, is_insert=False)
    req.reset_for_retract()
    other = _req("slot-taker", list(range(90000, 90000 + 2 * PS)))
    _run_batch(stack, [other])  # writes over other rows of the mirror meanwhile
    # Re-scheduled in a fresh slot (whose mirror row is stale): the prefix comes from the tree.
    _admit(stack, req)
    n = len(req.fill_ids)
    scheduler_batch.alloc_for_extend(stack, [req], [n])
    req.kv_committed_len = req.kv_allocated_len = n
    assert len(req.prefix_indices) == 3 * PS  # its prompt's cached pages, from the tree
    _check(stack, [req])
    release_kv_cache(req, cache)
    cache.check_hicache_events()
    _check(stack, [])
    assert cache.device_value_reads == 0


def test_direct_insert_is_counted_as_a_device_value_read(stack):
    tokens = list(range(1, 1 + 2 * PS))
    locs = stack.allocator.alloc(len(tokens))
    stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
    assert stack.cache.device_value_reads == 1  # the write-through needed the run
    assert nsa_stack.device_run_mismatches(stack.cache) == []


def test_run_checker_reports_a_wrong_run(stack):
    tokens = list(range(1, 1 + 2 * PS))
    locs = stack.allocator.alloc(len(tokens))
    stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
    (node,) = stack.cache.root_node.children.values()
    stack.cache._set_device_run(node, PageRun.of(node.cp_device_locs + PS, PS))
    assert len(nsa_stack.device_run_mismatches(stack.cache)) == 1
    node.cp_device_run, node.cp_device_locs = None, node.cp_device_locs + PS
    assert len(nsa_stack.device_run_mismatches(stack.cache)) == 1


def test_flag_off_batch_allocation_is_upstream(gloo_world1, plugins_loaded, monkeypatch):
    from sglang.srt.mem_cache import allocator as upstream_allocator

    from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch

    monkeypatch.setattr(upstream_allocator, "alloc_extend_kernel", NaiveExtendLaunch())
    cfg = nsa_stack.StackConfig(physical_tokens=PS * 12, req_pool_size=8, max_context_len=16 * PS)
    stack = nsa_stack.build_rank_stack(
        cfg, 0, None, gloo_world1, shared_kv=False, cache_cls=CpHiRadixCache
    )
    assert stack.cache.req_loc_mirror is None
    try:
        with scheduler_batch.cpu_scheduler_server_args(PS):
            req = Req(
                rid="off",
                origin_input_text="",
                origin_input_ids=list(range(PS + 3)),
                sampling_params=SamplingParams(max_new_tokens=1),
            )
            req.init_next_round_input(stack.cache)
            locs = scheduler_batch.alloc_for_extend(stack, [req], [PS + 3])
            row = stack.req_to_token_pool.req_to_token[req.req_pool_idx, : PS + 3]
            assert torch.equal(row.to(torch.int64), locs)
    finally:
        stack.close()
