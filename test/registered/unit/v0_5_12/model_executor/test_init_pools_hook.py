"""The _init_pools hook: physical NSA pool, logical owner-lane allocator, logical capacity;
the draft (NSA MTP) worker's pool mirrors the target's physical pool over one allocator."""

from types import SimpleNamespace

import pytest
import torch
from sglang.srt.mem_cache.allocator import PagedTokenToKVPoolAllocator
from sglang.srt.mem_cache.memory_pool import MLATokenToKVPool

from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator
from sglang_cp_hicache.v0_5_12.model_executor import model_runner_kv_cache_mixin as mixin
from sglang_cp_hicache.v0_5_12.server_args import FLAG, CpSharedKVConfigError
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

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


def test_flag_off_is_untouched(plugins_loaded):
    cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL)
    off = _runner(flag=False)
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), off)
    assert type(off.token_to_kv_pool_allocator) is PagedTokenToKVPoolAllocator
    assert off.max_total_num_tokens == PHYSICAL
    draft_off = _runner(flag=False, draft=True, allocator=off.token_to_kv_pool_allocator)
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), draft_off)
    assert draft_off.token_to_kv_pool_allocator is off.token_to_kv_pool_allocator


def _target_and_draft(draft_pool_factory, layer_num=2):
    """The target's pools, then a draft runner handed the target's allocator (as SGLang's
    EAGLE worker does through ``target_worker.get_memory_pool()``)."""
    cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL, layer_num=layer_num)
    target = _runner()
    mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), target)
    draft = _runner(draft=True, allocator=target.token_to_kv_pool_allocator)
    mixin.init_pools_around(_upstream_init_pools(draft_pool_factory), draft)
    return target, draft


def test_draft_pool_is_physical_and_shares_the_targets_allocator(plugins_loaded):
    draft_cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL, layer_num=1)  # NextN: 1 layer
    target, draft = _target_and_draft(lambda: nsa_stack.build_kv_pool(draft_cfg))
    allocator = target.token_to_kv_pool_allocator
    assert draft.token_to_kv_pool_allocator is allocator  # one logical allocator
    assert allocator.get_kvcache() is target.token_to_kv_pool  # capacity stays the target's
    # Physical, like the target's pool: a logical loc names the same slot in both (the
    # CPU twin checks the bytes a hooked draft forward writes there).
    assert draft.max_total_num_tokens == draft.token_to_kv_pool.size == target.token_to_kv_pool.size
    assert allocator.size == 4 * PHYSICAL


@pytest.mark.parametrize(
    "tokens, needle",
    [(PHYSICAL // 2, "mirror the target's physical pool"), (PHYSICAL, None)],
)
def test_draft_pool_of_another_size_fails_fast(plugins_loaded, tokens, needle):
    draft_cfg = nsa_stack.StackConfig(physical_tokens=tokens, layer_num=1)
    if needle is None:
        _target_and_draft(lambda: nsa_stack.build_kv_pool(draft_cfg))
        return
    with pytest.raises(CpSharedKVConfigError, match=needle):
        _target_and_draft(lambda: nsa_stack.build_kv_pool(draft_cfg))


def test_non_nsa_draft_fails_fast_naming_the_supported_drafts(plugins_loaded):
    def mla_pool():
        return MLATokenToKVPool(PHYSICAL, 64, torch.bfloat16, 512, 64, 1, "cpu", enable_memory_saver=False)

    with pytest.raises(CpSharedKVConfigError, match="NEXTN / EAGLE") as excinfo:
        _target_and_draft(mla_pool)
    assert "MLATokenToKVPool" in str(excinfo.value)


def test_draft_with_its_own_allocator_fails_fast(plugins_loaded):
    cfg = nsa_stack.StackConfig(physical_tokens=PHYSICAL, layer_num=1)
    own = PagedTokenToKVPoolAllocator(PHYSICAL, 64, torch.bfloat16, "cpu", nsa_stack.build_kv_pool(cfg), need_sort=True)
    draft = _runner(draft=True, allocator=own)
    with pytest.raises(CpSharedKVConfigError, match="target's logical owner-lane allocator"):
        mixin.init_pools_around(_upstream_init_pools(lambda: nsa_stack.build_kv_pool(cfg)), draft)


def test_non_nsa_pool_fails_fast(plugins_loaded):
    def mla_pool():
        return MLATokenToKVPool(
            PHYSICAL, 64, torch.bfloat16, 512, 64, 2, "cpu", enable_memory_saver=False
        )

    with pytest.raises(CpSharedKVConfigError, match="NSA KV pool"):
        mixin.init_pools_around(_upstream_init_pools(mla_pool), _runner())
