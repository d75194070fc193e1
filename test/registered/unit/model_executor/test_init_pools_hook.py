"""The _init_pools hook: physical NSA pool, logical owner-lane allocator, logical capacity."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from sglang_cp_hicache.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.model_executor import model_runner_kv_cache_mixin as mixin
from sglang_cp_hicache.server_args import FLAG, CpSharedKVConfigError
from sglang_cp_hicache.testing import nsa_stack

PHYSICAL = 64 * 8


def _runner(flag=True, draft=False, allocator=None):
    server_args = SimpleNamespace(**{FLAG: flag}, nsa_prefill_cp_mode="in-seq-split")
    return SimpleNamespace(
        server_args=server_args,
        is_draft_worker=draft,
        token_to_kv_pool_allocator=allocator,
        token_to_kv_pool=None,
        page_size=64,
        kv_cache_dtype=torch.bfloat16,
        device="cpu",
        max_total_num_tokens=PHYSICAL,
    )


def _upstream_init_pools(pool_factory):
    """What SGLang's _init_pools leaves behind for an NSA model (pool + paged allocator)."""

    def original(runner):
        runner.token_to_kv_pool = pool_factory()
        if runner.token_to_kv_pool_allocator is None:
            runner.token_to_kv_pool_allocator = PagedTokenToKVPoolAllocator(
                PHYSICAL, 64, torch.bfloat16, "cpu", runner.token_to_kv_pool, need_sort=True
            )

    return original


@pytest.fixture(autouse=True)
def cp_group_of_four(monkeypatch):
    monkeypatch.setattr(mixin, "_cp_rank_and_size", lambda: (1, 4))


def test_target_gets_logical_allocator_over_physical_pool(plugins_loaded):
    runner = _runner()
    cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL)
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), runner)
    allocator = runner.token_to_kv_pool_allocator
    assert isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator)
    assert allocator.get_kvcache() is runner.token_to_kv_pool
    assert runner.token_to_kv_pool.size == PHYSICAL  # the device pool stays physical
    assert allocator.size == runner.max_total_num_tokens == 4 * PHYSICAL
    assert (allocator.cp_rank, allocator.cp_size) == (1, 4)
    assert allocator.need_sort  # PD prefill keeps upstream's sorted free lists
    assert allocator.available_size() == 4 * PHYSICAL


def test_draft_worker_and_flag_off_are_untouched(plugins_loaded):
    cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL)
    off = _runner(flag=False)
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), off)
    assert type(off.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
    assert off.max_total_num_tokens == PHYSICAL
    shared = object()
    draft = _runner(draft=True, allocator=shared)
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), draft)
    assert draft.token_to_kv_pool_allocator is shared and draft.max_total_num_tokens == PHYSICAL


def test_non_nsa_pool_fails_fast(plugins_loaded):
    def mla_pool():
        return MLATokenToKVPool(
            PHYSICAL, 64, torch.bfloat16, 512, 64, 2, "cpu", enable_memory_saver=False
        )

    with pytest.raises(CpSharedKVConfigError, match="NSA KV pool"):
        mixin.init_pools_around(_upstream_init_pools(mla_pool), _runner())
