"""``v0_5_23.cache``: one ``CpCacheExtension`` per sharded ``UnifiedRadixCache``, built by
the AFTER hook on its ``__init__`` and found by ``extension_of`` from the cache, its tree
core, its allocator and (once the per-layer backup attaches) its KV pools; its host side
decided once by ``init_hicache``'s AFTER hook. On the real 0.5.23 sharded stack (cp 2, two
gloo ranks, the plugin's hooks applied): with the flag the extension is there, without it
(upstream's own sharding alone) every lookup answers None, so every per-call hook of the
other rooms is upstream's call."""

from __future__ import annotations

from typing import Dict

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks


def _lookups(ctx: RankContext, flag: bool) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of, host_extension_of

    with sharded_stack(ctx, StackConfig(cp_shared_kv=flag)) as stack:
        extension = extension_of(stack.cache)
        return {
            "attached": extension is not None,
            "mode": None if extension is None else extension.mode.value,
            "found": {
                "tree_core": extension_of(stack.cache.tree_core) is extension,
                "allocator": extension_of(stack.allocator) is extension,
                "kv_pool": extension_of(stack.kv_pool) is extension,
                "host": host_extension_of(stack.cache) is extension,
            },
            "lanes": None if extension is None else len(extension.chain_starts.per_base),
            "layer_backup": None if extension is None else extension.layer_backup is not None,
        }


@pytest.fixture(scope="module")
def per_flag() -> Dict[bool, list]:
    return {flag: run_ranks(2, _lookups, flag) for flag in (True, False)}


def test_the_flag_attaches_one_extension_found_from_the_cache_core_and_allocator(per_flag) -> None:
    for rank in per_flag[True]:
        assert rank["attached"] and rank["mode"] == "sharded"
        assert rank["found"]["tree_core"] and rank["found"]["allocator"]
        assert rank["lanes"] == 2


def test_init_hicache_sets_up_the_host_side_and_the_per_layer_backup(per_flag) -> None:
    """The host pool is upstream's sharded one (host room and L3 owner storage apply), and
    the per-layer backup attached its KV pool to the same extension."""
    for rank in per_flag[True]:
        assert rank["found"]["host"] and rank["found"]["kv_pool"]
        assert rank["layer_backup"]


def test_without_the_flag_upstreams_sharding_has_no_extension(per_flag) -> None:
    for rank in per_flag[False]:
        assert not rank["attached"] and rank["mode"] is None
        # extension_of answers None for every object: the per-call hooks are upstream's.
        assert rank["found"] == {"tree_core": True, "allocator": True, "kv_pool": True, "host": True}
        assert rank["layer_backup"] is None


def test_an_extension_serves_only_a_mode_that_shards_kv() -> None:
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import CpCacheExtension, extension_of
    from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode

    with pytest.raises(ValueError, match="not mode"):
        CpCacheExtension(cache=None, allocator=None, mode=CpMode.OFF)
    assert extension_of(42) is None  # not weak-referenceable: no extension, no error
