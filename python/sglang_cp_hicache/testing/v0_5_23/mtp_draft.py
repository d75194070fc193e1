"""The EAGLE MTP draft's KV on the REAL 0.5.23 stack (``StackConfig(mtp_draft=True)``).

On a PD prefill worker the draft's extend runs right after the target's forward, over the
same logical locs, and stores its one NextN layer in its own device pool
(``RankStack.draft_kv_pool``: sharded like the target's, same placement). Upstream packs
that layer as the host pools' tail layer ``layer_num + i`` in the target's host slots (KV
and DSA indexer alike), so a host page, and an L3 page object, carries target and draft.

:func:`store_draft_layer` is the draft layer's stores over a batch (index K pages, then the
latent in one ``set_mla_kv_buffer`` of the draft pool, which the plugin's store hook reports
to the draft stage of the per-layer backup); :func:`draft_forward` runs it and reports the
draft forward's end; :func:`write_draft_owned_rows` leaves the same bytes without a forward. :func:`host_layer_mismatches` and :func:`device_layer_mismatches` are
the byte checks on the side that reads: owned host rows of one host layer, owned device rows
of one pool layer, against the logical KV.
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import host_indexer_layer, host_latent_layer

#: One request of a batch: its logical locs and one pool's logical KV (latent
#: [layer, token, 1, dim], indexer [layer, page, bytes]), identical on every rank.
DraftItem = Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _draft_pool(stack: Any) -> Any:
    if stack.draft_kv_pool is None:
        raise ValueError("the stack has no MTP draft (StackConfig.mtp_draft)")
    return stack.draft_kv_pool


def draft_logical_kv(stack: Any, num_tokens: int, seed: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """A seeded draw of ``num_tokens`` tokens' draft latent rows and indexer pages."""
    pool = _draft_pool(stack)
    generator = torch.Generator().manual_seed(seed)
    layers = stack.config.draft_layer_num
    latent = torch.randn((layers, num_tokens, *pool.kv_buffer[0].shape[1:]), generator=generator)
    pages = num_tokens // stack.config.page_size
    page_shape = pool.index_k_with_scale_buffer[0].shape[1:]
    indexer = torch.randint(0, 256, (layers, pages, *page_shape), generator=generator)
    return latent.to(pool.kv_buffer[0].dtype), indexer.to(torch.uint8)


def store_draft_layer(stack: Any, layer_id: int, batch: Sequence[DraftItem]) -> None:
    """The draft layer ``layer_id``'s stores over ``batch`` in the draft pool (owned index
    K pages, then the batch's latent in one ``set_mla_kv_buffer``)."""
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.mem_cache.memory_pool import KVWriteLoc

    pool, page = _draft_pool(stack), stack.config.page_size
    for locs, (_, indexer) in batch:
        first_slots = locs[::page]
        owned_pages = torch.nonzero(stack.owned_mask(first_slots)).squeeze(1)
        page_rows = stack.physical_rows(first_slots) // page
        pool.index_k_with_scale_buffer[layer_id][page_rows] = indexer[layer_id][owned_pages]
    locs = torch.cat([locs for locs, _ in batch])
    rows = torch.cat([latent[layer_id] for _, (latent, _) in batch])
    rank = stack.config.kv_lora_rank
    layer = RadixAttention(num_heads=1, head_dim=rows.shape[-1], scaling=1.0, num_kv_heads=1, layer_id=layer_id)
    pool.set_mla_kv_buffer(layer, KVWriteLoc(locs), rows[..., :rank], rows[..., rank:])


def draft_forward(stack: Any, batch: Sequence[DraftItem], store: bool = True) -> None:
    """The draft forward: every draft layer's stores (none when not ``store``: a forward
    that skips the draft layer), then its end as the model-forward hook reports it."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import notify_forward_end

    if store:
        for layer_id in range(stack.config.draft_layer_num):
            store_draft_layer(stack, layer_id, batch)
    notify_forward_end(_draft_pool(stack))


def write_draft_owned_rows(stack: Any, logical_locs: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor]) -> None:
    """Store the owned share of the draft's ``kv`` at ``logical_locs`` directly in the
    draft pool's buffers (what the draft forward leaves there; no store hook runs)."""
    pool, page = _draft_pool(stack), stack.config.page_size
    latent, indexer = kv
    owned, rows = stack.owned_mask(logical_locs), stack.physical_rows(logical_locs)
    first = logical_locs[::page]
    page_positions = torch.nonzero(stack.owned_mask(first)).squeeze(1)
    page_rows = stack.physical_rows(first) // page
    for layer in range(stack.config.draft_layer_num):
        pool.kv_buffer[layer][rows] = latent[layer][owned]
        pool.index_k_with_scale_buffer[layer][page_rows] = indexer[layer][page_positions]


def host_layer_mismatches(
    stack: Any, logical_host_locs: torch.Tensor, host_layer: int, kv: Tuple[torch.Tensor, torch.Tensor], kv_layer: int
) -> List[str]:
    """Owned host latent rows and indexer pages of host layer ``host_layer`` at
    ``logical_host_locs`` (one request's, in token order) that differ from layer
    ``kv_layer`` of the logical ``kv``."""
    latent, indexer = kv
    page = stack.config.page_size
    owned = stack.owned_mask(logical_host_locs)
    host_rows = stack.physical_rows(logical_host_locs)
    first = logical_host_locs[::page]
    page_positions = torch.nonzero(stack.owned_mask(first)).squeeze(1)
    host_pages = stack.physical_rows(first) // page
    expected = latent[kv_layer][owned]
    host = host_latent_layer(stack.kv_host_pool, host_layer)[host_rows].view(expected.dtype).reshape(expected.shape)
    bad = [f"host layer {host_layer} latent row {int(r)}" for r in host_rows[(host != expected).flatten(1).any(1)]]
    host_index = host_indexer_layer(stack.indexer_host_pool, host_layer)[host_pages]
    differs = (host_index != indexer[kv_layer][page_positions]).any(1)
    return bad + [f"host layer {host_layer} indexer page {int(p)}" for p in host_pages[differs]]


def device_layer_mismatches(
    stack: Any, pool: Any, logical_locs: torch.Tensor, kv: Tuple[torch.Tensor, torch.Tensor], layers: range
) -> List[str]:
    """Owned device latent rows and indexer pages of ``pool`` (the target's or the draft's)
    at ``logical_locs`` that differ from the logical ``kv``, for each layer in ``layers``."""
    latent, indexer = kv
    page = stack.config.page_size
    owned = stack.owned_mask(logical_locs)
    rows = stack.physical_rows(logical_locs)
    first = logical_locs[::page]
    page_positions = torch.nonzero(stack.owned_mask(first)).squeeze(1)
    page_rows = stack.physical_rows(first) // page
    bad = []
    for layer in layers:
        differs = (pool.kv_buffer[layer][rows] != latent[layer][owned]).flatten(1).any(1)
        bad += [f"layer {layer} latent row {int(r)}" for r in rows[differs]]
        differs = (pool.index_k_with_scale_buffer[layer][page_rows] != indexer[layer][page_positions]).any(1)
        bad += [f"layer {layer} indexer page {int(p)}" for p in page_rows[differs]]
    return bad


__all__ = [
    "DraftItem",
    "device_layer_mismatches",
    "draft_forward",
    "draft_logical_kv",
    "host_layer_mismatches",
    "store_draft_layer",
    "write_draft_owned_rows",
]
