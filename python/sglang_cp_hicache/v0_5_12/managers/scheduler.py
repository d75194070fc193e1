"""The MTP draft's KV on host under CP HiCache (extends ``sglang.srt.managers.scheduler``).

SGLang builds the radix cache (``Scheduler.init_cache_with_memory_pool``) after the draft
worker, then registers a draft host pool with the cache controller
(``Scheduler._maybe_register_hicache_draft``): an MLA-only pool sized apart from the
target's, which the hybrid (NSA) controller ignores. Under ``--enable-nsa-prefill-cp-shared-kv``
with ``--enable-hierarchical-cache``:

* ``init_cache_with_memory_pool`` (AROUND) hands the draft worker's KV pool to the CP
  ``HiRadixCache`` being built (:func:`draft_kv_pool_scope`), which sizes target and draft
  host pools from one budget and moves them together;
* ``_maybe_register_hicache_draft`` (AROUND) never runs upstream's registration: it checks
  that the cache keeps exactly the scheduler's draft pool on host and fails fast otherwise.

Flag or HiCache off: both call SGLang's original. Both decide from the flag first (a real
``True``), so a scheduler whose attributes answer every name (a ``MagicMock``) is upstream's.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.v0_5_12.own_objects import cp_hiradix_cache
from sglang_cp_hicache.v0_5_12.server_args import CLI_FLAG, CpSharedKVConfigError, is_cp_shared_kv_enabled


def _cp_hicache(scheduler: Any) -> bool:
    return is_cp_shared_kv_enabled(scheduler.server_args) and scheduler.enable_hierarchical_cache is True


def _draft_kv_pool(scheduler: Any) -> Any:
    draft_kv_pool, _ = scheduler._get_draft_kv_pool()
    return draft_kv_pool


def init_cache_with_memory_pool_around(original: Callable, self: Any, *args, **kwargs) -> Any:
    if not _cp_hicache(self):
        return original(self, *args, **kwargs)
    from sglang_cp_hicache.v0_5_12.mem_cache.hiradix_cache import draft_kv_pool_scope

    with draft_kv_pool_scope(_draft_kv_pool(self)):
        return original(self, *args, **kwargs)


def maybe_register_hicache_draft_around(original: Callable, self: Any, *args, **kwargs) -> None:
    if not _cp_hicache(self):
        return original(self, *args, **kwargs)
    cache = cp_hiradix_cache(self.tree_cache)  # by type, inside SGLang's StreamingSession too
    if cache is None:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} with --enable-hierarchical-cache keeps the MTP draft's KV on host in "
            f"the plugin's CP HiRadixCache, but the scheduler's tree cache is "
            f"{type(self.tree_cache).__name__}"
        )
    cache.check_draft_kv_pool(_draft_kv_pool(self))
    return None
