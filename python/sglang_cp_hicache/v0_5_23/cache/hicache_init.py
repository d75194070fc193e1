"""AFTER ``UnifiedRadixCache.init_hicache``: what the line sets up once HiCache exists, in
order: the cache extension's host side (``cache_extension.decide_host_side``), then the
per-layer backup (``layer_backup.set_up``, which attaches to that extension). One hook on
the target, joining the two rooms, which do not import each other this way round."""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache.v0_5_23.backup import layer_backup
from sglang_cp_hicache.v0_5_23.cache.cache_extension import decide_host_side


def init_hicache_after(result: Any, cache: Any, server_args: Any, params: Any) -> None:
    decide_host_side(cache)
    layer_backup.set_up(cache, server_args)


__all__ = ["init_hicache_after"]
