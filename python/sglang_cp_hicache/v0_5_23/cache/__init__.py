"""Cache room: one ``CpCacheExtension`` per sharded ``UnifiedRadixCache``, the plugin's
state for that cache in one object (``cache_extension``), and what the line sets up once
HiCache exists (``hicache_init``). Every other room's per-call hook asks one question: is
an extension attached? Exports its hook specs by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"

HOOKS: Tuple[HookSpec, ...] = (
    # Built with the cache when the record's mode (launch/cp_mode.py, settled at
    # resolution) shards KV; its host side and per-layer backup when HiCache is.
    HookSpec(
        f"{_URC}.__init__",
        "sglang_cp_hicache.v0_5_23.cache.cache_extension:cache_init_after",
        "AFTER",
    ),
    HookSpec(
        f"{_URC}.init_hicache",
        "sglang_cp_hicache.v0_5_23.cache.hicache_init:init_hicache_after",
        "AFTER",
    ),
)
