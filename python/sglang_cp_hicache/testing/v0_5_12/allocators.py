"""Allocators on the CPU runtime: the CP owner-lane allocator without a KV pool, and
upstream's ``alloc_extend`` with its Triton kernel replaced by upstream's torch reference."""

from __future__ import annotations

import torch

from sglang_cp_hicache.v0_5_12.mem_cache.cp_shared_allocator import CPSharedPagedTokenToKVPoolAllocator


def build_cp_allocator(
    cp_size: int,
    page_size: int,
    pages_per_lane: int,
    cp_rank: int = 0,
    need_sort: bool = False,
) -> CPSharedPagedTokenToKVPoolAllocator:
    """Rank ``cp_rank``'s allocator with ``pages_per_lane`` pages in every owner lane."""
    return CPSharedPagedTokenToKVPoolAllocator(
        physical_size=pages_per_lane * page_size,
        page_size=page_size,
        dtype=torch.bfloat16,
        device="cpu",
        kvcache=None,
        need_sort=need_sort,
        cp_size=cp_size,
        cp_rank=cp_rank,
    )


class NaiveExtendLaunch:
    """Stands in for ``alloc_extend_kernel[grid](...)`` (Triton, no CPU backend): runs
    upstream's pure-torch ``alloc_extend_naive`` with the same positional arguments, so the
    real upstream ``PagedTokenToKVPoolAllocator.alloc_extend`` runs on CPU.

    Install with ``sglang.srt.mem_cache.allocator.alloc_extend_kernel = NaiveExtendLaunch()``.
    """

    def __getitem__(self, grid):
        from sglang.srt.mem_cache.allocator import alloc_extend_naive

        def launch(prefix_lens, seq_lens, last_loc, free_pages, out_indices, _bs_upper, page_size):
            alloc_extend_naive(
                prefix_lens, seq_lens, last_loc, free_pages, out_indices, page_size, "cpu"
            )

        return launch
