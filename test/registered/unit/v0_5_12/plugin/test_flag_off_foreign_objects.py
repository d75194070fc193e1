"""Flag off means upstream, whatever objects SGLang (or its own unit tests) hand the hooks.

Upstream's scheduler tests build ``PrefillAdder`` over a ``MagicMock()`` tree cache; SGLang
wraps caches in a ``StreamingSession`` that forwards every unknown attribute to the cache
inside. Such objects answer every attribute name, so a hook that decides "is this ours?" by
``getattr``/``hasattr`` takes the plugin's path on them. Each hook must decide from the flag
(strictly ``True``), from ``isinstance`` of the plugin's own classes, or from an attribute
the plugin itself stored on the instance, never from attribute presence.

Per hook family, with the flag off and foreign objects (``MagicMock`` where upstream's tests
use one, else a minimal real object): SGLang's original is called once with the same
arguments, its result comes back unchanged, and the foreign objects get no call and no
attribute from the plugin. Admission also runs end to end through SGLang's real
``PrefillAdder`` against the unhooked original (``HookRegistry`` keeps it as ``__wrapped__``).
"""

from __future__ import annotations

import argparse
import types
from typing import Any, Callable, List, Tuple
from unittest.mock import MagicMock

import numpy as np
import pytest
import torch

from sglang_cp_hicache.v0_5_12 import hooks as hook_table
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR
from sglang_cp_hicache.v0_5_12.server_args import FLAG, MATERIALIZE_DEST

# Every entry of v0_5_12.hooks.HOOKS, by target, with how it decides that the flag is off.
VERDICTS = {
    "sglang.srt.server_args:ServerArgs.add_cli_args": "always adds the options (default off)",
    "sglang.srt.server_args:ServerArgs.from_cli_args": "carries only values argparse can produce",
    "sglang.srt.server_args:ServerArgs.__init__": "the flag keyword / parsed value",
    "sglang.srt.server_args:ServerArgs.__post_init__": "flag",
    "sglang.srt.server_args:ServerArgs.check_server_args": "flag",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin:ModelRunnerKVCacheMixin._init_pools": "flag",
    "sglang.srt.mem_cache.common:alloc_for_extend": "own class (CpHiRadixCache in CP mode)",
    "sglang.srt.mem_cache.common:alloc_for_decode": "own class (CpHiRadixCache in CP mode)",
    "sglang.srt.managers.schedule_batch:ScheduleBatch.get_model_worker_batch": "own class (BatchLogicalPages)",
    "sglang.srt.model_executor.forward_batch_info:ForwardBatch.init_new": "own class (BatchLogicalPages)",
    "sglang.srt.mem_cache.hiradix_cache:HiRadixCache": "own class (the CP allocator)",
    "sglang.srt.managers.scheduler:Scheduler.init_cache_with_memory_pool": "flag",
    "sglang.srt.managers.scheduler:Scheduler._maybe_register_hicache_draft": "flag",
    "sglang.srt.managers.schedule_policy:PrefillAdder.add_one_req": "own class + own budget",
    "sglang.srt.managers.schedule_batch:ScheduleBatch.prepare_for_extend": "own class (CpHiRadixCache in CP mode)",
    "sglang.srt.layers.attention.nsa_backend:NativeSparseAttnBackend.init_forward_metadata": "flag",
    "sglang.srt.layers.attention.nsa_backend:NativeSparseAttnBackend.forward_extend": "own instance attribute",
    "sglang.srt.layers.attention.nsa.nsa_indexer:Indexer.forward_cuda": "own instance attribute",
    "sglang.srt.layers.attention.nsa.nsa_indexer:Indexer._store_index_k_cache": "own instance attribute",
    "sglang.srt.models.deepseek_v2:DeepseekV2ForCausalLM.forward": "own instance attribute",
    "sglang.srt.models.deepseek_nextn:DeepseekV3ForCausalLMNextN.forward": "own instance attribute",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin:ModelRunnerKVCacheMixin.init_memory_pool": "flag",
    "sglang.srt.model_executor.model_runner_kv_cache_mixin:ModelRunnerKVCacheMixin._profile_available_bytes": "flag",
    "sglang.srt.model_executor.model_runner:ModelRunner._dummy_run": "no decision (a scope only)",
    "sglang.srt.disaggregation.utils:filter_kv_indices_for_cp_rank": "flag",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.maybe_send_extra": "flag",
    "sglang.srt.disaggregation.mooncake.conn:MooncakeKVManager.send_kvcache_hisparse": "own product type (owned positions)",
    "sglang.srt.disaggregation.common.conn:CommonKVManager.register_to_bootstrap": "flag",
}


def test_every_hook_of_the_table_is_audited():
    assert sorted(VERDICTS) == sorted(spec.target for spec in hook_table.HOOKS)


class Original:
    """Stands in for the hooked SGLang function: records its calls, returns a fresh object
    (so a hook that touches the result shows on it)."""

    def __init__(self) -> None:
        self.calls: List[Tuple[tuple, dict]] = []
        self.result = types.SimpleNamespace()

    def __call__(self, *args, **kwargs) -> Any:
        self.calls.append((args, kwargs))
        return self.result


def assert_upstream(hook: Callable, *args, **kwargs) -> Original:
    """``hook`` called as HookRegistry calls an AROUND hook is SGLang's original, unchanged."""
    original = Original()
    assert hook(original, *args, **kwargs) is original.result
    assert original.calls == [(args, kwargs)]
    assert vars(original.result) == {}
    return original


def assert_untouched(*mocks: MagicMock) -> None:
    for mock in mocks:
        assert mock.mock_calls == [], mock.mock_calls


@pytest.fixture
def flag_off_globals(monkeypatch):
    """The process-wide state a flag-off scheduler has: global server args that answer
    every name (upstream tests set a mock), no dense-buffer budget reserved."""
    import sglang.srt.server_args as server_args_module

    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_budget

    monkeypatch.setattr(server_args_module, "_global_server_args", MagicMock())
    monkeypatch.setattr(cp_shared_kv_budget, "_active_budget", None)


def _streaming_session(inner: Any) -> Any:
    from sglang.srt.session.streaming_session import StreamingSession

    return StreamingSession(inner)


# ------------------------------------------------------------------------- admission
def _mock_tree_cache() -> MagicMock:
    """Upstream's prefill-adder test tree cache (``create_tree_cache``)."""
    from sglang.srt.mem_cache.base_prefix_cache import DecLockRefResult, IncLockRefResult

    tree_cache = MagicMock()
    tree_cache.full_evictable_size.return_value = 0
    tree_cache.swa_evictable_size.return_value = 0
    tree_cache.evictable_size.return_value = 0
    tree_cache.supports_mamba.return_value = False
    tree_cache.disable = False
    tree_cache.inc_lock_ref.return_value = IncLockRefResult()
    tree_cache.dec_lock_ref.return_value = DecLockRefResult()
    return tree_cache


def _admission(tree_cache: MagicMock):
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.sampling.sampling_params import SamplingParams

    allocator = MagicMock()
    allocator.available_size.return_value = 10_000
    adder = PrefillAdder(
        page_size=1,
        tree_cache=tree_cache,
        token_to_kv_pool_allocator=allocator,
        running_batch=None,
        new_token_ratio=1.0,
        rem_input_tokens=10_000,
        rem_chunk_tokens=None,
    )
    req = Req("r0", "", list(range(1, 33)), SamplingParams(max_new_tokens=8))
    req.fill_ids = list(req.origin_input_ids)
    req.prefix_indices = torch.empty(0, dtype=torch.int64)
    req.set_extend_input_len(len(req.fill_ids))
    req.last_node = MagicMock()
    return adder, req


def _call_names(mock: MagicMock) -> List[str]:
    return [name for name, _, _ in mock.mock_calls]


def test_admission_over_a_mock_tree_cache_is_upstreams(plugins_loaded, monkeypatch):
    """The issue: upstream's admission tests with the plugin loaded and the flag off."""
    from sglang.srt.managers.schedule_policy import PrefillAdder
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    import sglang.srt.server_args as server_args_module

    from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_budget

    monkeypatch.setattr(server_args_module, "_global_server_args", None)
    set_global_server_args_for_scheduler(ServerArgs(model_path="dummy"))
    monkeypatch.setattr(cp_shared_kv_budget, "_active_budget", None)  # flag off: none reserved
    hooked = PrefillAdder.add_one_req
    upstream = hooked.__wrapped__
    runs = {}
    for name, add_one_req in (("hooked", hooked), ("upstream", upstream)):
        tree_cache = _mock_tree_cache()
        adder, req = _admission(tree_cache)
        result = add_one_req(adder, req, has_chunked_req=False, truncation_align_size=None)
        runs[name] = (result, [r.rid for r in adder.can_run_list], _call_names(tree_cache))
    assert runs["upstream"][1] == ["r0"]  # the request is admitted upstream
    assert runs["hooked"] == runs["upstream"]


@pytest.mark.parametrize("wrap", [False, True], ids=["mock", "streaming_session_around_mock"])
def test_admission_hook_passes_a_foreign_cache_to_upstream(flag_off_globals, wrap):
    from sglang_cp_hicache.v0_5_12.managers.schedule_policy import add_one_req_around

    tree_cache = _mock_tree_cache()
    adder = types.SimpleNamespace(
        tree_cache=_streaming_session(tree_cache) if wrap else tree_cache, can_run_list=[], rem_chunk_tokens=None
    )
    assert_upstream(add_one_req_around, adder, MagicMock(), False, None)
    assert_untouched(tree_cache)


# ------------------------------------------------- schedule batch / forward batch carriage
@pytest.mark.parametrize("wrap", [False, True], ids=["mock", "streaming_session_around_mock"])
def test_prepare_for_extend_leaves_a_foreign_cache_alone(flag_off_globals, wrap):
    from sglang.srt.managers.schedule_batch import ScheduleBatch

    from sglang_cp_hicache.v0_5_12.managers.schedule_batch import prepare_for_extend_after

    tree_cache = MagicMock()
    batch = ScheduleBatch(reqs=[MagicMock(), MagicMock()], tree_cache=_streaming_session(tree_cache) if wrap else tree_cache)
    assert prepare_for_extend_after(None, batch) is None
    assert_untouched(tree_cache)


def test_worker_and_forward_batches_carry_nothing_from_foreign_batches(flag_off_globals):
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch

    from sglang_cp_hicache.v0_5_12.managers.schedule_batch import get_model_worker_batch_around
    from sglang_cp_hicache.v0_5_12.model_executor.forward_batch_info import init_new_around

    schedule_batch, worker_batch, model_runner = MagicMock(), MagicMock(), MagicMock()
    assert_upstream(get_model_worker_batch_around, schedule_batch)
    original = Original()
    forward_batch = init_new_around(original, ForwardBatch, worker_batch, model_runner)
    assert forward_batch is original.result and original.calls == [((ForwardBatch, worker_batch, model_runner), {})]
    assert vars(forward_batch) == {LOGICAL_PAGES_ATTR: None}  # says it carries no snapshot
    assert_untouched(schedule_batch, worker_batch, model_runner)
    assert LOGICAL_PAGES_ATTR not in vars(schedule_batch) and LOGICAL_PAGES_ATTR not in vars(worker_batch)


# ------------------------------------------------------------ alloc_for_extend / decode
@pytest.mark.parametrize("wrap", [False, True], ids=["mock", "streaming_session_around_mock"])
@pytest.mark.parametrize("token_per_req", [1, 2])
def test_allocation_over_a_foreign_cache_is_upstreams(flag_off_globals, wrap, token_per_req):
    from sglang_cp_hicache.v0_5_12.mem_cache.common import alloc_for_decode_around, alloc_for_extend_around

    tree_cache = MagicMock()
    batch = MagicMock()
    batch.tree_cache = _streaming_session(tree_cache) if wrap else tree_cache
    assert_upstream(alloc_for_extend_around, batch)
    assert_upstream(alloc_for_decode_around, batch, token_per_req=token_per_req)
    assert_untouched(tree_cache)
    assert LOGICAL_PAGES_ATTR not in vars(batch)


# ------------------------------------------------------------------ scheduler draft hooks
def test_scheduler_draft_hooks_are_upstreams_for_a_mock_scheduler(flag_off_globals):
    from sglang_cp_hicache.v0_5_12.managers import scheduler as scheduler_hooks

    scheduler = MagicMock()  # its server_args, enable_hierarchical_cache: mocks, not True
    assert_upstream(scheduler_hooks.init_cache_with_memory_pool_around, scheduler)
    assert_upstream(scheduler_hooks.maybe_register_hicache_draft_around, scheduler)
    assert_untouched(scheduler)


@pytest.fixture
def cp_draft_stack(gloo_world1):
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    stack = nsa_stack.build_rank_stack(
        nsa_stack.StackConfig(cp_size=2, physical_tokens=64 * 16, draft=True), 0, None, gloo_world1
    )
    yield stack
    stack.close()


def test_flag_on_the_draft_check_finds_the_cache_inside_sglangs_streaming_session(cp_draft_stack):
    """The one wrapper SGLang puts around the cache is unwrapped by its type; another object
    with an ``inner`` is not taken for it (flag on: fail fast, never run upstream's)."""
    from sglang_cp_hicache.v0_5_12.managers import scheduler as scheduler_hooks
    from sglang_cp_hicache.v0_5_12.server_args import CpSharedKVConfigError

    def scheduler(tree_cache):
        return types.SimpleNamespace(
            server_args=types.SimpleNamespace(**{FLAG: True}),
            enable_hierarchical_cache=True,
            tree_cache=tree_cache,
            _get_draft_kv_pool=lambda: (cp_draft_stack.draft_pool, None),
        )

    def never(*args, **kwargs):
        raise AssertionError("upstream's MLA-only draft host pool registration ran")

    scheduler_hooks.maybe_register_hicache_draft_around(never, scheduler(_streaming_session(cp_draft_stack.cache)))
    with pytest.raises(CpSharedKVConfigError, match="CP HiRadixCache.*MagicMock"):
        scheduler_hooks.maybe_register_hicache_draft_around(never, scheduler(MagicMock(inner=cp_draft_stack.cache)))


# ------------------------------------------------------------- pools and startup hooks
def test_pool_and_startup_hooks_are_upstreams_for_a_mock_model_runner(flag_off_globals):
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import profile_available_bytes_around
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import init_memory_pool_around
    from sglang_cp_hicache.v0_5_12.layers.attention.nsa_backend_hooks import dummy_run_around
    from sglang_cp_hicache.v0_5_12.model_executor.model_runner_kv_cache_mixin import init_pools_around

    for is_draft_worker in (False, True):
        runner = MagicMock(is_draft_worker=is_draft_worker)  # server_args: a mock, not the flag
        assert_upstream(init_pools_around, runner, 1, key=2)
        assert_upstream(init_memory_pool_around, runner, 1, key=2)
        assert_upstream(profile_available_bytes_around, runner, 1, key=2)
        assert_upstream(dummy_run_around, runner, 1, key=2)
        assert_untouched(runner)


# ------------------------------------------------------------------ NSA attention hooks
def test_nsa_hooks_are_upstreams_for_mock_batches_and_pools(flag_off_globals):
    from sglang_cp_hicache.v0_5_12.layers.attention import nsa_backend_hooks as nsa

    backend, indexer, model, layer = MagicMock(), MagicMock(), MagicMock(), MagicMock()
    forward_batch = MagicMock()  # its token_to_kv_pool: a mock pool answering every name
    q, k, v, x = (torch.zeros(1) for _ in range(4))
    assert_upstream(nsa.init_forward_metadata_around, backend, forward_batch)
    assert_upstream(nsa.forward_extend_around, backend, q, k, v, layer, forward_batch, save_kv_cache=True)
    assert_upstream(nsa.indexer_forward_around, indexer, x, q, k, forward_batch, 3)
    assert_upstream(nsa.store_index_k_cache_around, indexer, forward_batch, 3, k)
    assert_upstream(nsa.model_forward_around, model, q, k, forward_batch)
    assert_untouched(backend, indexer, model, layer, forward_batch)
    assert nsa.STATE_ATTR not in vars(forward_batch)


# ------------------------------------------------------------------------- PD filters
def test_pd_filters_are_upstreams_for_a_mock_kv_manager(flag_off_globals):
    from sglang_cp_hicache.v0_5_12.disaggregation.mooncake.conn import (
        maybe_send_extra_around,
        send_kvcache_hisparse_around,
    )
    from sglang_cp_hicache.v0_5_12.disaggregation.common.conn import register_to_bootstrap_around
    from sglang_cp_hicache.v0_5_12.disaggregation.utils import filter_kv_indices_for_cp_rank_around

    kv_mgr, req, executor, page_index_slice = MagicMock(), MagicMock(), MagicMock(), MagicMock()
    kv_indices = np.arange(8)
    assert_upstream(filter_kv_indices_for_cp_rank_around, kv_mgr, kv_indices, slice(0, 8))
    assert_upstream(maybe_send_extra_around, kv_mgr, req, [kv_indices], executor, None)
    assert_upstream(
        send_kvcache_hisparse_around, kv_mgr, "session", kv_indices, [1], np.arange(16), page_index_slice, executor
    )
    assert_upstream(send_kvcache_hisparse_around, kv_mgr, "session", kv_indices, [1], np.arange(16), slice(0, 2), executor)
    assert_upstream(register_to_bootstrap_around, kv_mgr)  # no wait for a bootstrap server
    assert_untouched(kv_mgr, req, executor, page_index_slice)


# ------------------------------------------------------------------------ server args
def test_validation_hooks_leave_mock_server_args_to_upstream():
    from sglang_cp_hicache.v0_5_12.launch_check import check_server_args_after
    from sglang_cp_hicache.v0_5_12.server_args import post_init_after

    server_args = MagicMock()  # answers every name: the flag is a mock, not True
    assert check_server_args_after(None, server_args) is None
    assert post_init_after(None, server_args) is None
    assert_untouched(server_args)


def test_a_namespace_answering_every_name_carries_no_plugin_option():
    from sglang_cp_hicache.v0_5_12.server_args import parsed_plugin_values

    assert parsed_plugin_values(MagicMock()) == {}
    assert parsed_plugin_values(argparse.Namespace()) == {}
    parsed = argparse.Namespace(**{FLAG: True, MATERIALIZE_DEST: "all_reduce"})
    assert parsed_plugin_values(parsed) == {FLAG: True, MATERIALIZE_DEST: "all_reduce"}


def test_flag_off_cli_parses_upstreams_values(plugins_loaded):
    """The hooked parser only adds the plugin's two options (defaults: off, auto)."""
    from sglang.srt.server_args import ServerArgs

    upstream_add_cli_args = vars(ServerArgs)["add_cli_args"].__func__.__wrapped__
    argv = ["--model-path", "dummy", "--page-size", "64", "--enable-hierarchical-cache"]
    hooked_parser, upstream_parser = argparse.ArgumentParser(), argparse.ArgumentParser()
    ServerArgs.add_cli_args(hooked_parser)
    upstream_add_cli_args(upstream_parser)
    hooked, upstream = vars(hooked_parser.parse_args(argv)), vars(upstream_parser.parse_args(argv))
    assert {hooked.pop(FLAG), hooked.pop(MATERIALIZE_DEST)} == {False, "auto"}
    assert hooked == upstream
    args = ServerArgs.from_cli_args(hooked_parser.parse_args(argv))
    assert getattr(args, FLAG) is False
