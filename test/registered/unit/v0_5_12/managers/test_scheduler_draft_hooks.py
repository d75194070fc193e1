"""The scheduler's draft-on-host seams under CP HiCache (``managers/scheduler.py`` hooks).

SGLang builds the cache after the draft worker, then registers an MLA-only draft host pool
(``_maybe_register_hicache_draft``). With the flag and HiCache the cache must be built with
the draft worker's pool, and upstream's registration must never run; anything else is
SGLang's own path.
"""

from types import SimpleNamespace

import pytest

from sglang_cp_hicache.v0_5_12.managers import scheduler as hooks
from sglang_cp_hicache.v0_5_12.mem_cache import hiradix_cache
from sglang_cp_hicache.v0_5_12.server_args import FLAG, CpSharedKVConfigError
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


def _scheduler(draft_pool, tree_cache=None, flag=True, hicache=True):
    server_args = SimpleNamespace(**{FLAG: flag})
    return SimpleNamespace(
        server_args=server_args,
        enable_hierarchical_cache=hicache,
        tree_cache=tree_cache,
        _get_draft_kv_pool=lambda: (draft_pool, None),
    )


def _never(*args, **kwargs):
    raise AssertionError("upstream's MLA-only draft host pool registration ran")


def test_the_cache_is_built_with_the_draft_workers_pool():
    draft_pool = object()
    seen = []

    def init_cache(self):
        seen.append(hiradix_cache._draft_kv_pool.get())

    hooks.init_cache_with_memory_pool_around(init_cache, _scheduler(draft_pool))
    assert seen == [draft_pool]
    assert hiradix_cache._draft_kv_pool.get() is None  # only while the cache is built
    hooks.init_cache_with_memory_pool_around(init_cache, _scheduler(draft_pool, flag=False))
    hooks.init_cache_with_memory_pool_around(init_cache, _scheduler(draft_pool, hicache=False))
    assert seen == [draft_pool, None, None]


@pytest.fixture
def draft_stack(gloo_world1):
    stack = nsa_stack.build_rank_stack(
        nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16, draft=True), 0, None, gloo_world1
    )
    yield stack
    stack.close()


def test_upstream_draft_registration_is_replaced_by_a_check(draft_stack):
    cache = draft_stack.cache
    hooks.maybe_register_hicache_draft_around(_never, _scheduler(draft_stack.draft_pool, cache))
    from sglang.srt.session.streaming_session import StreamingSession

    wrapped = StreamingSession(cache)  # the scheduler's wrapper when streaming sessions are on
    hooks.maybe_register_hicache_draft_around(_never, _scheduler(draft_stack.draft_pool, wrapped))
    with pytest.raises(CpSharedKVConfigError, match="CP rank 0: the CP HiRadixCache keeps another draft KV pool"):
        hooks.maybe_register_hicache_draft_around(_never, _scheduler(nsa_stack.build_kv_pool(
            nsa_stack.StackConfig(physical_tokens=PS * 16), layer_num=1), cache))
    with pytest.raises(CpSharedKVConfigError, match="the scheduler has no draft worker"):
        hooks.maybe_register_hicache_draft_around(_never, _scheduler(None, cache))


def test_a_cache_built_without_the_scheduler_draft_pool_is_refused(gloo_world1):
    stack = nsa_stack.build_rank_stack(
        nsa_stack.StackConfig(cp_size=2, physical_tokens=PS * 16), 0, None, gloo_world1
    )
    try:
        draft_pool = nsa_stack.build_kv_pool(nsa_stack.StackConfig(physical_tokens=PS * 16), layer_num=1)
        with pytest.raises(CpSharedKVConfigError, match="has a draft KV pool .* built without it"):
            hooks.maybe_register_hicache_draft_around(_never, _scheduler(draft_pool, stack.cache))
        hooks.maybe_register_hicache_draft_around(_never, _scheduler(None, stack.cache))  # no draft: fine
    finally:
        stack.close()


def test_flag_or_hicache_off_runs_upstreams_registration():
    calls = []
    for scheduler in (_scheduler(object(), flag=False), _scheduler(object(), hicache=False)):
        hooks.maybe_register_hicache_draft_around(lambda self: calls.append(self), scheduler)
    assert len(calls) == 2


def test_both_hooks_are_in_the_hook_table():
    from sglang_cp_hicache.v0_5_12.hooks import HOOKS

    targets = {spec.target: spec.hook for spec in HOOKS}
    scheduler = "sglang.srt.managers.scheduler:Scheduler"
    assert targets[f"{scheduler}.init_cache_with_memory_pool"].endswith(":init_cache_with_memory_pool_around")
    assert targets[f"{scheduler}._maybe_register_hicache_draft"].endswith(":maybe_register_hicache_draft_around")
