"""When the event check may skip its all-reduce (``v0_5_23/cache/event_sync.py``): only on a
cache with an extension, and only with nothing in flight by state every rank holds alike;
each condition that must keep the reduce keeps it."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

IDLE = dict(
    ongoing_write_through={}, ongoing_load_back={}, enable_storage=False, buffer_pipeline=None,
    linker=None, pp_size=1,
)  # fmt: skip
BUSY = {
    "a write pending": {"ongoing_write_through": {7: "pending"}},
    "a load pending": {"ongoing_load_back": {9: "pending"}},
    "an L3 tier (its queues are filled by rank-local threads)": {"enable_storage": True},
    "a buffer pipeline": {"buffer_pipeline": object()},
    "an external linker": {"linker": object()},
    "pipeline parallelism": {"pp_size": 2},
}


class _Cache:
    """The fields the decision reads (hashable and weak-referenceable, as a cache is)."""

    def __init__(self, **fields) -> None:
        self.__dict__.update(fields)


def _with_extension(**fields) -> _Cache:
    from sglang_cp_hicache.v0_5_23.cache import cache_extension

    cache = _Cache(**fields)
    cache_extension._register(cache, SimpleNamespace())
    return cache


def _sync(cache: _Cache):
    from sglang_cp_hicache.v0_5_23.cache.event_sync import sync_ready_counts_around

    calls = []

    def upstream(c):
        calls.append(c)
        return "upstream's reduce"

    return sync_ready_counts_around(upstream, cache), calls


def test_an_idle_cache_with_an_extension_answers_nothing_ready_without_the_reduce() -> None:
    from sglang_cp_hicache.v0_5_23.cache.event_sync import NOTHING_READY

    cache = _with_extension(**IDLE)
    assert _sync(cache) == (NOTHING_READY, [])


@pytest.mark.parametrize("why", list(BUSY))
def test_anything_in_flight_keeps_upstreams_reduce(why) -> None:
    cache = _with_extension(**{**IDLE, **BUSY[why]})
    assert _sync(cache) == ("upstream's reduce", [cache])


def test_a_cache_without_an_extension_is_upstreams_call() -> None:
    cache = _Cache(**IDLE)
    assert _sync(cache) == ("upstream's reduce", [cache])
