"""Prefill admission under CP shared KV, through SGLang's real ``PrefillAdder``.

A batch whose KV pages would exceed the dense buffers reserved at init is cut at admission
(the request waits for a later batch); a request larger than the reservation alone is
aborted there; so the forward's ``check_batch`` is never reached from the scheduler.
"""

import random

import numpy as np
import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_budget as budget_mod
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import DenseBufferBudget
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_mapping import build_batch_mapping
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

PAGE = 64


@pytest.fixture
def scheduler(plugins_loaded, monkeypatch):
    """What one scheduler rank admits with: real radix cache, paged allocator, server args
    (prefill CP round-robin split, which batches several requests)."""
    from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.radix_cache import RadixCache
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    from sglang_cp_hicache.testing.v0_5_12.nsa_stack import StackConfig, build_kv_pool

    import sglang.srt.server_args as server_args_mod

    monkeypatch.setattr(server_args_mod, "_global_server_args", None)
    set_global_server_args_for_scheduler(
        ServerArgs(model_path="dummy", page_size=PAGE, enable_nsa_prefill_context_parallel=True,
                   nsa_prefill_cp_mode="round-robin-split")
    )
    cfg = StackConfig(physical_tokens=PAGE * 256, page_size=PAGE)
    allocator = PagedTokenToKVPoolAllocator(
        cfg.physical_tokens, page_size=PAGE, dtype=torch.bfloat16, device="cpu",
        kvcache=build_kv_pool(cfg), need_sort=False,
    )
    req_to_token = ReqToTokenPool(16, 8192, device="cpu", enable_memory_saver=False)
    cache = RadixCache(CacheInitParams(disable=False, req_to_token_pool=req_to_token,
                                       token_to_kv_pool_allocator=allocator, page_size=PAGE))
    return cache, allocator


def _budget(monkeypatch, pages):
    budget = DenseBufferBudget(max_prefix_tokens=pages * PAGE, bytes_per_token=788, page_size=PAGE, cp_size=2)
    monkeypatch.setattr(budget_mod, "_active_budget", budget)
    return budget


def _req(rid, num_tokens, seed=0):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    tokens = random.Random(seed).sample(range(1, 50000), num_tokens)
    return Req(str(rid), "", tokens, SamplingParams(max_new_tokens=4))


def _admit_round(cache, allocator, waiting, chunk_tokens=None):
    """``Scheduler._get_new_batch_prefill_raw``'s admission loop; returns the batch."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    adder = PrefillAdder(PAGE, cache, allocator, None, 1.0, 1 << 20, chunk_tokens)
    for req in waiting:
        req.init_next_round_input(cache)
        if adder.add_one_req(req, has_chunked_req=False, truncation_align_size=None) != AddReqResult.CONTINUE:
            break
    for req in adder.can_run_list:
        cache.dec_lock_ref(req.last_node)
    return adder.can_run_list


def test_a_batch_is_cut_where_the_dense_buffers_end(scheduler, monkeypatch):
    cache, allocator = scheduler
    waiting = [_req(0, 300, 0), _req(1, 200, 1), _req(2, 100, 2)]  # 5, 4, 2 pages
    _budget(monkeypatch, 8)
    batch = _admit_round(cache, allocator, waiting)
    assert [r.rid for r in batch] == ["0"]  # 5 + 4 pages > 8: request 1 waits, and 2 behind it
    assert waiting[1].to_finish is None
    waiting = [r for r in waiting if r not in batch]
    assert [r.rid for r in _admit_round(cache, allocator, waiting)] == ["1", "2"]  # 4 + 2 pages
    monkeypatch.setattr(budget_mod, "_active_budget", None)  # flag off: SGLang's own admission
    assert len(_admit_round(cache, allocator, [_req(3, 300, 3), _req(4, 200, 4)])) == 2


def test_with_chunked_prefill_a_request_counts_only_the_chunk_it_can_get(scheduler, monkeypatch):
    """Request 1 (7 pages) would not fit next to request 0 (2 pages) in 8 pages, but the
    chunk budget left (4 pages) cuts it to 4: admitted, as a chunked request."""
    cache, allocator = scheduler
    _budget(monkeypatch, 8)
    waiting = [_req(0, 2 * PAGE, 0), _req(1, 7 * PAGE, 1)]
    batch = _admit_round(cache, allocator, waiting, chunk_tokens=6 * PAGE)
    assert [r.rid for r in batch] == ["0", "1"] and len(batch[1].fill_ids) == 4 * PAGE
    waiting = [_req(2, 2 * PAGE, 2), _req(3, 7 * PAGE, 3)]
    assert len(_admit_round(cache, allocator, waiting, chunk_tokens=9 * PAGE)) == 1  # 2 + 7 > 8


def test_a_cached_prefix_counts_with_the_chunk(scheduler, monkeypatch):
    """Request 1 has 3 of its 7 pages cached: after the 4-page chunk it reads all 7, which
    do not fit next to request 0's 2 pages; and the forward would have refused them."""
    from sglang.srt.mem_cache.base_prefix_cache import InsertParams
    from sglang.srt.mem_cache.radix_cache import RadixKey

    cache, allocator = scheduler
    budget = _budget(monkeypatch, 8)
    cached = _req(1, 7 * PAGE, 1)
    cache.insert(InsertParams(key=RadixKey(cached.origin_input_ids[: 3 * PAGE]), value=allocator.alloc(3 * PAGE)))
    waiting = [_req(0, 2 * PAGE, 0), cached]
    batch = _admit_round(cache, allocator, waiting, chunk_tokens=6 * PAGE)
    assert [r.rid for r in batch] == ["0"] and len(cached.prefix_indices) == 3 * PAGE
    with pytest.raises(budget_mod.SharedKVBudgetExceeded):
        budget.check_batch(2 + 7)


def test_admitted_batches_never_reach_the_forward_check(scheduler, monkeypatch):
    """Every batch admission lets through fits the forward's check, even with no page
    shared between requests (the most distinct pages a batch can read)."""
    cache, allocator = scheduler
    budget = _budget(monkeypatch, 16)
    layout = CpSharedKVLayout(2, 0, PAGE)
    rng = random.Random(14)
    waiting = [_req(i, rng.randint(1, 16 * PAGE - 1), i) for i in range(40)]
    rounds = cuts = 0
    while waiting:
        batch = _admit_round(cache, allocator, waiting, chunk_tokens=rng.choice([None, 4 * PAGE, 12 * PAGE]))
        assert batch, "a lone request always fits"
        rounds += 1
        cuts += len(batch) < len(waiting)
        pages, next_page = [], 1
        for req in batch:
            n = -(-len(req.fill_ids) // PAGE)
            pages.append(np.arange(next_page, next_page + n))
            next_page += n
        mapping = build_batch_mapping(layout, pages, [0] * len(batch), "cpu")
        budget.check_batch(mapping.num_dense_pages - 1)
        waiting = [r for r in waiting if r not in batch]
    assert cuts >= rounds - 1 and rounds < 40  # batches were cut, and held several requests


def test_a_request_larger_than_the_reservation_is_aborted_at_admission(scheduler, monkeypatch):
    import sglang.srt.managers.schedule_batch as schedule_batch

    monkeypatch.setattr(schedule_batch, "get_tensor_model_parallel_rank", lambda: 0)  # the abort logs on TP rank 0
    cache, allocator = scheduler
    _budget(monkeypatch, 4)
    big = _req(0, 5 * PAGE, 0)
    batch = _admit_round(cache, allocator, [big])
    assert batch == [big] and big.fill_ids == [0]  # SGLang's abort: a one-token prefill
    assert "dense buffers were reserved" in big.to_finish.message and "request 0 reads 5 KV pages" in big.to_finish.message


def test_admission_reads_nothing_from_the_device(scheduler, monkeypatch):
    """The decision uses host lengths only (``prefix_indices`` is a device tensor on a GPU)."""
    from sglang.srt.managers.schedule_policy import AddReqResult, PrefillAdder

    from sglang_cp_hicache.v0_5_12.managers.schedule_policy import add_one_req_around
    from sglang_cp_hicache.testing.host_reads import device_only, recording_host_reads

    cache, allocator = scheduler
    _budget(monkeypatch, 6)
    adder = PrefillAdder(PAGE, cache, allocator, None, 1.0, 1 << 20, 4 * PAGE)
    admitted, candidate = _req(0, 3 * PAGE, 0), _req(1, 6 * PAGE, 1)
    for req in (admitted, candidate):
        req.init_next_round_input(cache)
        req.prefix_indices = device_only(req.prefix_indices)
    adder.can_run_list.append(admitted)
    with recording_host_reads() as reads:
        result = add_one_req_around(lambda *args: AddReqResult.CONTINUE, adder, candidate, False, None)
    assert result == AddReqResult.OTHER and reads == []  # 3 + min(6, 0 + 4) pages > 6
