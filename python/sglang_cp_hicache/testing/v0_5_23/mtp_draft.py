"""The EAGLE MTP draft's KV on the REAL 0.5.23 stack (``StackConfig(mtp_draft=True)``).

On a PD prefill worker the draft's extend runs right after the target's forward, over the
same logical locs, and stores its one NextN layer in its own device pool
(``RankStack.draft_kv_pool``: sharded like the target's, same placement). Upstream packs
that layer as the host pools' tail layer ``layer_num + i`` in the target's host slots (KV
and DSA indexer alike), so a host page, and an L3 page object, carries target and draft.

:func:`store_draft_layer` is the draft layer's stores over a batch (index K pages, then the
latent in one ``set_mla_kv_buffer`` of the draft pool, which the plugin's store hook reports
to the draft stage of the per-layer backup); :func:`draft_forward` runs it and reports the
draft forward's end; :func:`host_layer_mismatches` checks, on the side that reads, the owned
host rows of one host layer against the logical KV (the device rows, the same bytes without a
forward and their draw: :mod:`~sglang_cp_hicache.testing.v0_5_23.owned_kv` with the draft's
pool).
"""

from __future__ import annotations

from typing import Any, List, Sequence, Tuple

import torch

from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import (
    host_indexer_layer,
    host_latent_layer,
    store_pool_layer,
)
from sglang_cp_hicache.testing.v0_5_23.owned_kv import LogicalKV, logical_kv

#: One request of a batch: its logical locs and one pool's logical KV (latent
#: [layer, token, 1, dim], indexer [layer, page, bytes]), identical on every rank.
DraftItem = Tuple[torch.Tensor, Tuple[torch.Tensor, torch.Tensor]]


def _draft_pool(stack: Any) -> Any:
    if stack.draft_kv_pool is None:
        raise ValueError("the stack has no MTP draft (StackConfig.mtp_draft)")
    return stack.draft_kv_pool


def draft_logical_kv(stack: Any, num_tokens: int, seed: int) -> LogicalKV:
    """A seeded draw of ``num_tokens`` tokens' draft latent rows and indexer pages."""
    return logical_kv(stack, num_tokens, stack.config.draft_layer_num, seed, _draft_pool(stack))


def store_draft_layer(stack: Any, layer_id: int, batch: Sequence[DraftItem]) -> None:
    """The draft layer ``layer_id``'s stores over ``batch`` in the draft pool (owned index
    K pages, then the batch's latent in one ``set_mla_kv_buffer``)."""
    store_pool_layer(stack, _draft_pool(stack), layer_id, batch)


def draft_forward(stack: Any, batch: Sequence[DraftItem], store: bool = True) -> None:
    """The draft forward: every draft layer's stores (none when not ``store``: a forward
    that skips the draft layer), then its end as the model-forward hook reports it."""
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import notify_forward_end

    if store:
        for layer_id in range(stack.config.draft_layer_num):
            store_draft_layer(stack, layer_id, batch)
    notify_forward_end(_draft_pool(stack))


def host_layer_mismatches(
    stack: Any, logical_host_locs: torch.Tensor, host_layer: int, kv: Tuple[torch.Tensor, torch.Tensor], kv_layer: int
) -> List[str]:
    """Owned host latent rows and indexer pages of host layer ``host_layer`` at
    ``logical_host_locs`` (one request's, in token order) that differ from layer
    ``kv_layer`` of the logical ``kv``."""
    latent, indexer = kv
    owned = stack.owned_mask(logical_host_locs)
    host_rows = stack.physical_rows(logical_host_locs)
    page_positions, host_pages = stack.owned_pages(logical_host_locs)
    expected = latent[kv_layer][owned]
    host = host_latent_layer(stack.kv_host_pool, host_layer)[host_rows].view(expected.dtype).reshape(expected.shape)
    bad = [f"host layer {host_layer} latent row {int(r)}" for r in host_rows[(host != expected).flatten(1).any(1)]]
    host_index = host_indexer_layer(stack.indexer_host_pool, host_layer)[host_pages]
    differs = (host_index != indexer[kv_layer][page_positions]).any(1)
    return bad + [f"host layer {host_layer} indexer page {int(p)}" for p in host_pages[differs]]


__all__ = [
    "DraftItem",
    "draft_forward",
    "draft_logical_kv",
    "host_layer_mismatches",
    "store_draft_layer",
]
