"""The batch's logical pages, carried from ``alloc_for_extend`` to the forward on the host.

SGLang's own ``alloc_for_extend`` on a ``ScheduleBatch``, ``get_model_worker_batch`` and
``ForwardBatch.init_new`` (with the plugin's hooks), real ``Req``s, on one rank of a CP-2
stack: random batches with shared prefixes, chunked prefill (de-duplicated against a
request of the same batch), device cache hits and load-backs from host. Every forward
batch carries its requests' logical pages, equal to the page-start columns of
``req_to_token`` at the forward's ``req_pool_indices`` (the forward's request order).
"""

from __future__ import annotations

import random
from types import SimpleNamespace
from typing import List

import numpy as np
import pytest
import torch
from sglang.srt.managers.schedule_batch import Req
from sglang.srt.mem_cache.base_prefix_cache import InitLoadBackParams
from sglang.srt.mem_cache.common import release_kv_cache
from sglang.srt.sampling.sampling_params import SamplingParams

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import (
    forward_logical_pages,
    read_request_logical_pages,
)
from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR, BatchLogicalPages
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack, scheduler_batch

PS = 64


@pytest.fixture
def stack(gloo_world1, plugins_loaded):
    cfg = nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 12, req_pool_size=8, max_context_len=16 * PS)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1)
    assert isinstance(stack.cache, CpHiRadixCache) and stack.cache.req_loc_mirror is not None
    with scheduler_batch.cpu_scheduler_server_args(PS):
        yield stack
    stack.close()


def _req(rid: str, ids: List[int]) -> Req:
    return Req(rid=rid, origin_input_text="", origin_input_ids=ids, sampling_params=SamplingParams(max_new_tokens=1))


def _admit(stack, req: Req) -> int:
    """Scheduler match, then PrefillAdder's load-back and lock; loaded tokens."""
    cache = stack.cache
    req.init_next_round_input(cache)
    loaded = 0
    if req.host_hit_length > 0:
        new_indices, req.last_node = cache.init_load_back(
            InitLoadBackParams(best_match_node=req.best_match_node, host_hit_length=req.host_hit_length, req=req)
        )
        loaded = len(new_indices)
        req.prefix_indices = torch.cat([req.prefix_indices, new_indices])
        req.cache_protected_len = len(req.prefix_indices)
    cache.inc_lock_ref(req.last_node)
    return loaded


def _assert_carried_pages_are_the_device_columns(stack, forward_batch) -> None:
    carried = getattr(forward_batch, LOGICAL_PAGES_ATTR)
    assert carried is not None
    device = read_request_logical_pages(
        stack.req_to_token_pool.req_to_token,
        forward_batch.req_pool_indices,
        forward_batch.seq_lens_cpu.tolist(),
        PS,
    )
    assert [p.tolist() for p in forward_logical_pages(forward_batch, PS)] == [p.tolist() for p in device]


def test_carried_pages_equal_the_device_page_columns_of_random_batches(stack):
    cache, rng = stack.cache, random.Random(14)
    prefixes = [[1000 * k + i for i in range(4 * PS)] for k in range(1, 4)]
    hits = loaded = chunked = 0
    for b in range(16):
        reqs = [
            _req(
                f"b{b}r{i}",
                rng.choice(prefixes)[: rng.randint(PS // 2, 4 * PS)]
                + [100000 * b + 1000 * i + t for t in range(rng.randint(1, 3 * PS))],
            )
            for i in range(rng.randint(1, 2))
        ]
        loaded += sum(_admit(stack, req) for req in reqs)
        hits += sum(len(req.prefix_indices) > 0 for req in reqs)
        cache.ready_to_load_host_cache()
        active = list(reqs)
        while active:
            chunk = rng.randint(PS // 2, 3 * PS)
            seq_lens = [min(len(r.origin_input_ids), len(r.prefix_indices) + chunk) for r in active]
            for req, n in zip(active, seq_lens):
                req.fill_ids = req.origin_input_ids[:n]
            batch = scheduler_batch.extend_batch(stack, active, seq_lens)
            _assert_carried_pages_are_the_device_columns(stack, scheduler_batch.forward_batch(stack, batch))
            for req, n in zip(active, seq_lens):
                req.kv_committed_len = req.kv_allocated_len = n
                req.is_chunked = int(n < len(req.origin_input_ids))
                chunked += req.is_chunked
                cache.cache_unfinished_req(req, chunked=bool(req.is_chunked))
            active = [r for r, n in zip(active, seq_lens) if n < len(r.origin_input_ids)]
        for req in reqs:
            release_kv_cache(req, cache)
        cache.check_hicache_events()
    # The paths this test pins were all taken.
    assert hits > 0 and loaded > 0 and chunked > 0


def test_a_batch_changed_since_its_allocation_carries_no_pages(stack):
    reqs = [_req("a", list(range(1, 1 + PS + 7))), _req("b", list(range(5000, 5000 + 2 * PS)))]
    for req in reqs:
        _admit(stack, req)
    batch = scheduler_batch.extend_batch(stack, reqs, [len(r.origin_input_ids) for r in reqs])
    assert getattr(scheduler_batch.forward_batch(stack, batch), LOGICAL_PAGES_ATTR) is not None
    batch.seq_lens_cpu = batch.seq_lens_cpu + 1  # its lens grew (as in a decode step)
    assert getattr(scheduler_batch.forward_batch(stack, batch), LOGICAL_PAGES_ATTR) is None
    batch.seq_lens_cpu = batch.seq_lens_cpu - 1
    batch.reqs.reverse()  # the same requests, another order
    assert getattr(scheduler_batch.forward_batch(stack, batch), LOGICAL_PAGES_ATTR) is None


def test_a_snapshot_is_taken_for_its_slots_in_order_and_lens():
    pages = BatchLogicalPages(req_pool_indices=(3, 1), seq_lens=(70, 5), pages=(np.array([4, 9]), np.array([2])))
    assert pages.taken_for([3, 1], [70, 5])
    assert not pages.taken_for([1, 3], [5, 70])
    assert not pages.taken_for([3, 1, 2], [70, 5, 1])
    assert not pages.taken_for([3, 1], [71, 6])
    assert not pages.taken_for([3, None], [70, 5])  # a request without a req slot


def test_a_forward_whose_lens_are_not_those_of_its_pages_fails_fast():
    carried = BatchLogicalPages(req_pool_indices=(0,), seq_lens=(70,), pages=(np.array([4, 9]),))
    forward_batch = SimpleNamespace(seq_lens_cpu=torch.tensor([71]), **{LOGICAL_PAGES_ATTR: carried})
    with pytest.raises(ValueError, match=r"lens \[71\].*\[70\]"):
        forward_logical_pages(forward_batch, PS)


def test_without_a_mirror_nothing_is_carried(gloo_world1, plugins_loaded, monkeypatch):
    from sglang.srt.mem_cache import allocator as upstream_allocator

    from sglang_cp_hicache.testing.v0_5_12.allocators import NaiveExtendLaunch

    monkeypatch.setattr(upstream_allocator, "alloc_extend_kernel", NaiveExtendLaunch())
    cfg = nsa_stack.StackConfig(physical_tokens=PS * 12, req_pool_size=8, max_context_len=16 * PS)
    stack = nsa_stack.build_rank_stack(cfg, 0, None, gloo_world1, shared_kv=False, cache_cls=CpHiRadixCache)
    assert stack.cache.req_loc_mirror is None
    try:
        with scheduler_batch.cpu_scheduler_server_args(PS):
            req = _req("off", list(range(PS + 3)))
            req.init_next_round_input(stack.cache)
            batch = scheduler_batch.extend_batch(stack, [req], [PS + 3])
            assert getattr(scheduler_batch.forward_batch(stack, batch), LOGICAL_PAGES_ATTR) is None
    finally:
        stack.close()
