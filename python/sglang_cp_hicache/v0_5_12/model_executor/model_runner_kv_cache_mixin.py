"""Pool wiring under CP shared KV (extends ``ModelRunnerKVCacheMixin._init_pools``).

The NSA device pool stays *physical*: profiled and sized per rank exactly as upstream does.
The target worker's allocator becomes the *logical* owner-lane allocator over that pool,
and ``max_total_num_tokens`` becomes logical (physical x cp_size), which is what the
scheduler, radix cache and req_to_token see. ``memory_pool_config`` keeps the physical size,
so draft pools built from it later stay physical and reuse the target's logical allocator.

The draft (NSA MTP) worker receives the target's ``req_to_token_pool`` and allocator from
SGLang; :func:`check_draft_pool` proves its pool is the one the shared-KV runtime serves:
an NSA pool with the target's physical slots and page geometry, so one logical loc names
the same physical owner slot in both pools and the startup self-test covers both.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang_cp_hicache.v0_5_12.hooks import verify_hooks_installed
from sglang_cp_hicache.v0_5_12.server_args import CLI_FLAG, CpSharedKVConfigError, is_cp_shared_kv_enabled

logger = logging.getLogger(__name__)


def _cp_rank_and_size() -> tuple[int, int]:
    from sglang.srt.layers.dp_attention import get_attention_cp_rank, get_attention_cp_size

    return get_attention_cp_rank(), get_attention_cp_size()


def install_cp_shared_allocator(model_runner: Any, cp_rank: int, cp_size: int) -> None:
    """Swap the target worker's physical allocator for the logical owner-lane allocator."""
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (
        CPSharedPagedTokenToKVPoolAllocator,
    )

    pool = model_runner.token_to_kv_pool
    if not isinstance(pool, NSATokenToKVPool) or isinstance(pool, HiSparseNSATokenToKVPool):
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} needs an NSA KV pool (DeepSeek-V3.2 / GLM-5 sparse attention); "
            f"this model built {type(pool).__name__}"
        )
    if cp_size < 2:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} needs an attention CP group of 2 or more ranks, got {cp_size}"
        )
    old_allocator = model_runner.token_to_kv_pool_allocator
    physical_size = pool.size
    model_runner.token_to_kv_pool_allocator = CPSharedPagedTokenToKVPoolAllocator(
        physical_size,
        page_size=model_runner.page_size,
        dtype=model_runner.kv_cache_dtype,
        device=model_runner.device,
        kvcache=pool,
        need_sort=getattr(old_allocator, "need_sort", False),
        cp_size=cp_size,
        cp_rank=cp_rank,
    )
    model_runner.max_total_num_tokens = model_runner.token_to_kv_pool_allocator.size
    logger.info(
        "CP shared KV: rank %d/%d holds %d physical KV tokens; logical capacity %d tokens",
        cp_rank,
        cp_size,
        physical_size,
        model_runner.max_total_num_tokens,
    )


def check_draft_pool(model_runner: Any) -> None:
    """Fail fast unless the draft worker's pool mirrors the target's under shared KV.

    Invariant checked: the draft allocates through the target's logical owner-lane
    allocator, and its NSA pool has the target pool's physical size and per-layer
    geometry, so a draft write at a logical loc lands on the target's physical slot.
    """
    from sglang.srt.mem_cache.hisparse_memory_pool import HiSparseNSATokenToKVPool
    from sglang.srt.mem_cache.memory_pool import NSATokenToKVPool

    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import PagedLayerGeometry
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import (
        CPSharedPagedTokenToKVPoolAllocator,
    )

    pool = model_runner.token_to_kv_pool
    if not isinstance(pool, NSATokenToKVPool) or isinstance(pool, HiSparseNSATokenToKVPool):
        raise CpSharedKVConfigError(
            f"{CLI_FLAG} supports speculative decoding with an NSA draft only (NEXTN / EAGLE "
            f"with the DeepSeek-V3.2 / GLM-5 MTP layer); the draft model built "
            f"{type(pool).__name__}"
        )
    allocator = model_runner.token_to_kv_pool_allocator
    if not isinstance(allocator, CPSharedPagedTokenToKVPoolAllocator):
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: the draft worker must allocate through the target's logical "
            f"owner-lane allocator, got {type(allocator).__name__}"
        )
    target_pool = allocator.get_kvcache()
    draft_geometry = PagedLayerGeometry.of_pool(pool)
    target_geometry = PagedLayerGeometry.of_pool(target_pool)
    if pool.size != target_pool.size or draft_geometry != target_geometry:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: the draft KV pool must mirror the target's physical pool on rank "
            f"{allocator.cp_rank} (same slots, same page geometry): draft {pool.size} tokens "
            f"{draft_geometry}, target {target_pool.size} tokens {target_geometry}"
        )
    logger.info(
        "CP shared KV: draft pool on rank %d/%d mirrors the target's %d physical KV tokens "
        "(%d draft layers, one logical allocator)",
        allocator.cp_rank,
        allocator.cp_size,
        pool.size,
        len(pool.kv_buffer),
    )


def init_pools_around(original: Callable, self: Any, *args, **kwargs) -> Any:
    """AROUND ``_init_pools``: flag off (anything but a real ``True``), SGLang's own."""
    if not is_cp_shared_kv_enabled(self.server_args):
        return original(self, *args, **kwargs)
    is_draft = bool(getattr(self, "is_draft_worker", False))
    is_target = not is_draft and self.token_to_kv_pool_allocator is None
    result = original(self, *args, **kwargs)
    if is_target:
        verify_hooks_installed()
        cp_rank, cp_size = _cp_rank_and_size()
        install_cp_shared_allocator(self, cp_rank, cp_size)
    elif is_draft:
        check_draft_pool(self)
    return result
