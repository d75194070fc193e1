"""Dense-buffer memory reserved out of the KV budget at init; oversized batches refused."""

from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_budget as budget_mod
from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import (
    DenseBufferBudget,
    SharedKVBudgetExceeded,
)


def _runner(enabled=True, kv_dtype=torch.bfloat16, context_len=131072):
    return SimpleNamespace(
        server_args=SimpleNamespace(enable_nsa_prefill_cp_shared_kv=enabled),
        model_config=SimpleNamespace(context_len=context_len, kv_lora_rank=512, qk_rope_head_dim=64),
        kv_cache_dtype=kv_dtype,
        page_size=64,
        is_draft_worker=False,
    )


def test_budget_covers_layers_in_flight_and_all_gather_staging():
    b = DenseBufferBudget(max_prefix_tokens=131072, bytes_per_token=788, page_size=64, cp_size=8)
    dense = (131072 // 64 + 1) * 64 * 788
    assert b.dense_buffer_bytes == dense
    assert b.reserved_bytes == 2 * dense + 9 * (-(-dense // 8))
    assert b.max_batch_pages == 131072 // 64  # a full-context request: the dense buffer less padding
    b.check_batch(131072 // 64)
    with pytest.raises(SharedKVBudgetExceeded, match="refusing the batch"):
        b.check_batch(131072 // 64 + 1)
    odd = DenseBufferBudget(max_prefix_tokens=100, bytes_per_token=1, page_size=64, cp_size=2)
    assert odd.max_batch_pages == 2 and odd.dense_buffer_bytes == 3 * 64


def test_bytes_per_token_follow_the_kv_dtype():
    assert budget_mod.kv_bytes_per_token(_runner(kv_dtype=torch.bfloat16)) == 1152 + 132
    assert budget_mod.kv_bytes_per_token(_runner(kv_dtype=torch.float8_e4m3fn)) == 656 + 132


def test_profile_hook_reserves_and_logs(monkeypatch, caplog):
    import sglang.srt.layers.dp_attention as dp

    monkeypatch.setattr(dp, "get_attention_cp_size", lambda: 8)
    # The hook sets the process-wide budget; restore it so no later test inherits it.
    monkeypatch.setattr(budget_mod, "_active_budget", budget_mod.active_budget())
    runner = _runner()
    available = 100 * 2**30
    with caplog.at_level("INFO"):
        left = budget_mod.profile_available_bytes_around(lambda self: available, runner)
    reserved = getattr(runner, budget_mod.BUDGET_ATTR).reserved_bytes
    assert left == available - reserved and reserved > 2 * 131072 * 1284
    assert "reserved" in caplog.text and "dense buffers" in caplog.text
    assert budget_mod.active_budget() is getattr(runner, budget_mod.BUDGET_ATTR)
    assert budget_mod.profile_available_bytes_around(lambda self: available, _runner(enabled=False)) == available
    with pytest.raises(SharedKVBudgetExceeded, match="lower --context-length"):
        budget_mod.profile_available_bytes_around(lambda self: 2**20, _runner())


def test_an_oversized_batch_is_refused_before_the_forward_allocates(monkeypatch):
    """Through the real hook: init_forward_metadata refuses, no pipeline is built."""
    from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as hooks
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    page = 64
    layout = CpSharedKVLayout(2, 0, page)
    tiny = DenseBufferBudget(max_prefix_tokens=2 * page, bytes_per_token=788, page_size=page, cp_size=2)
    backend = SimpleNamespace(forward_metadata=None)
    setattr(backend, hooks.RUNTIME_ATTR, hooks.CpSharedKVRuntime(layout, None, "all_reduce", False, budget=tiny))
    req_to_token = torch.arange(10 * page, dtype=torch.int32).view(1, -1) + 2 * page
    batch = SimpleNamespace(
        forward_mode=ForwardMode.EXTEND, batch_size=1,
        req_to_token_pool=SimpleNamespace(req_to_token=req_to_token),
        req_pool_indices=torch.tensor([0]), seq_lens_cpu=torch.tensor([5 * page]),
        extend_prefix_lens_cpu=[4 * page], out_cache_loc=req_to_token[0, 4 * page : 5 * page].long(),
        token_to_kv_pool=SimpleNamespace(size=20 * page, page_size=page),
    )
    with pytest.raises(SharedKVBudgetExceeded, match="reads 5 KV pages"):
        hooks.init_forward_metadata_around(lambda self, fb: None, backend, batch)
    assert getattr(batch, hooks.STATE_ATTR) is None
