"""Planted faults of upstream's sharded read path, shared by the CPU tests
(``test/registered/multi_rank/v0_5_23/{native,selftest}/``) and the device twins
(``device_twins.misread_prefix_page``): each patches an upstream class for one block and
restores it, and each must make the comparison (or the self-test) fail where it acts."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch

from sglang_cp_hicache.testing.planted import patched

#: ``rewrite(pool, loc, rows)``: the scratch rows a faulty translation gives for ``loc``.
RowRewrite = Callable[[Any, torch.Tensor, torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def scratch_table_rewritten(rewrite: RowRewrite) -> Iterator[None]:
    """``rewrite`` applied to ``translate_loc_to_scratch`` while a backend builds its
    metadata only: the chunk staging and the index-K writes keep the real translation, so
    only the table the attention kernel reads is wrong."""
    from sglang.srt.layers.attention.dsa_backend import DeepseekSparseAttnBackend
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    translate = PageInterleaveKVPoolMixin.__dict__["translate_loc_to_scratch"]

    def faulty(pool: Any, loc: torch.Tensor) -> torch.Tensor:
        return rewrite(pool, loc, translate(pool, loc))

    def make(init: Callable[..., Any]) -> Callable[..., Any]:
        def init_with_faulty_table(backend: Any, forward_batch: Any) -> Any:
            PageInterleaveKVPoolMixin.translate_loc_to_scratch = faulty
            try:
                return init(backend, forward_batch)
            finally:
                PageInterleaveKVPoolMixin.translate_loc_to_scratch = translate

        return init_with_faulty_table

    with patched(DeepseekSparseAttnBackend, "init_forward_metadata", make):
        yield


def wrong_owner(pool: Any, loc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Each prefix row read from the same page of the next owner's gathered block."""
    ps, block, size = pool.page_size, pool._block_pages, pool.shard_size
    if not block:
        return rows
    page = rows // ps
    moved = (page // block + 1) % size * block + page % block
    return torch.where(page < size * block, moved * ps + rows % ps, rows)


def prefix_rows_one_page_on(pool: Any, loc: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Every prefix row read one page further in the scratch (another page's KV)."""
    prefix_rows = pool.shard_size * pool._block_pages * pool.page_size
    return torch.where(rows < prefix_rows, rows + pool.page_size, rows)


@contextlib.contextmanager
def prefetch_skipped(skips: Callable[[Any, int], bool]) -> Iterator[None]:
    """``_prefetch_layer`` marks the slot resident without its prefix all-gather for each
    (pool, layer) ``skips`` names: the slot keeps an earlier layer's prefix."""
    from sglang.srt.mem_cache.page_interleave_pool import PageInterleaveKVPoolMixin

    def make(prefetch: Callable[[Any, int], Any]) -> Callable[[Any, int], Any]:
        def skipping(pool: Any, layer_id: int) -> Any:
            if not skips(pool, layer_id):
                return prefetch(pool, layer_id)
            pool._slots[layer_id % 2].resident_key = (layer_id, pool._epoch)
            return None

        return skipping

    with patched(PageInterleaveKVPoolMixin, "_prefetch_layer", make):
        yield


__all__ = ["prefetch_skipped", "prefix_rows_one_page_on", "scratch_table_rewritten", "wrong_owner"]
