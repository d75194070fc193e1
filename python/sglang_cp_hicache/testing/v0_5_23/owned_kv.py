"""A request's logical KV on the REAL 0.5.23 stack: drawn, its owned share written into one
rank's device pool, and read back against it.

The logical KV (:class:`LogicalKV`) is identical on every rank: latent rows by token
position, DSA indexer pages by page. A rank stores only what it owns, at its physical rows
(``RankStack.owned_mask`` / ``physical_rows`` / ``owned_pages``); the target's pool and the
MTP draft's are placed alike, so every function takes the pool (the target's by default).
"""

from __future__ import annotations

from typing import Any, List, NamedTuple, Optional, Tuple

import torch

#: A logical KV as (latent, indexer): a :class:`LogicalKV` or any pair of those tensors.
KVPair = Tuple[torch.Tensor, torch.Tensor]


class LogicalKV(NamedTuple):
    """The full logical KV of one request by token position (identical on every rank)."""

    latent: torch.Tensor  # [layer, token, 1, kv_cache_dim]
    indexer: torch.Tensor  # [layer, page, page bytes] uint8


def logical_kv(stack: Any, num_tokens: int, layers: int, seed: int, pool: Any = None) -> LogicalKV:
    """A seeded draw of ``num_tokens`` tokens' latent rows and indexer pages over ``layers``
    layers, shaped as ``pool``'s buffers (the target's by default)."""
    pool = stack.kv_pool if pool is None else pool
    generator = torch.Generator().manual_seed(seed)
    latent = torch.randn((layers, num_tokens, *pool.kv_buffer[0].shape[1:]), generator=generator)
    index_page = pool.index_k_with_scale_buffer[0].shape[1:]
    pages = num_tokens // stack.config.page_size
    indexer = torch.randint(0, 256, (layers, pages, *index_page), generator=generator)
    return LogicalKV(latent.to(pool.kv_buffer[0].dtype), indexer.to(torch.uint8))


def write_owned_rows(
    stack: Any, logical_locs: torch.Tensor, kv: KVPair, pool: Any = None, layers: Optional[range] = None
) -> None:
    """Store the owned share of ``kv`` at ``logical_locs`` directly in ``pool``'s buffers
    (what a forward leaves there; no store hook runs), every layer of the pool unless
    ``layers``."""
    pool, (latent, indexer) = stack.kv_pool if pool is None else pool, kv
    owned, rows = stack.owned_mask(logical_locs), stack.physical_rows(logical_locs)
    page_positions, page_rows = stack.owned_pages(logical_locs)
    for layer in range(pool.layer_num) if layers is None else layers:
        pool.kv_buffer[layer][rows] = latent[layer][owned]
        pool.index_k_with_scale_buffer[layer][page_rows] = indexer[layer][page_positions]


def owned_row_mismatches(
    stack: Any, logical_locs: torch.Tensor, kv: KVPair, pool: Any = None, layers: Optional[range] = None
) -> List[str]:
    """Owned latent rows and indexer pages of ``pool`` (the target's by default) at
    ``logical_locs`` that differ from ``kv``, one line each, every layer of the pool unless
    ``layers`` (none: the bytes are there)."""
    pool, (latent, indexer) = stack.kv_pool if pool is None else pool, kv
    owned, rows = stack.owned_mask(logical_locs), stack.physical_rows(logical_locs)
    page_positions, page_rows = stack.owned_pages(logical_locs)
    bad: List[str] = []
    for layer in range(pool.layer_num) if layers is None else layers:
        differs = (pool.kv_buffer[layer][rows] != latent[layer][owned]).flatten(1).any(1)
        bad += [f"layer {layer} latent row {int(r)}" for r in rows[differs]]
        differs = (pool.index_k_with_scale_buffer[layer][page_rows] != indexer[layer][page_positions]).any(1)
        bad += [f"layer {layer} indexer page {int(p)}" for p in page_rows[differs]]
    return bad


__all__ = ["KVPair", "LogicalKV", "logical_kv", "owned_row_mismatches", "write_owned_rows"]
