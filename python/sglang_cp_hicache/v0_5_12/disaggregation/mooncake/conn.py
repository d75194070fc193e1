"""Mooncake's NSA state transfer (indexer K/scale pages) under CP shared KV.

``MooncakeKVManager.maybe_send_extra`` pairs the request's logical NSA state pages with the
decode side's pages position by position and sends all of them. Under shared KV a rank
holds only its owned pages, so the hook keeps the owned pairs, with physical source ids
(see :mod:`sglang_cp_hicache.v0_5_12.disaggregation.utils`). Other state types pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from sglang_cp_hicache.v0_5_12.disaggregation.utils import layout_of_kv_manager, owned_pages_for_transfer
from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled


def owned_state_pages(
    layout: CpSharedKVLayout, src_logical_pages: Sequence[int], dst_pages: Sequence[int]
) -> Tuple[List[int], List[int]]:
    """Owned ``(physical source, destination)`` page pairs of a positional page mapping.

    Pairs beyond the shorter list are dropped first, as upstream does.
    """
    count = min(len(src_logical_pages), len(dst_pages))
    src = np.asarray(src_logical_pages[:count], dtype=np.int64)
    share = owned_pages_for_transfer(layout, src)
    dst = np.asarray(dst_pages[:count], dtype=np.int64)[share.dst_positions]
    return share.physical_pages.tolist(), dst.tolist()


def filter_nsa_state_indices(
    layout: CpSharedKVLayout,
    state_types: Sequence[Any],
    prefill_state_indices: Sequence[Optional[Sequence[int]]],
    dst_state_indices: Sequence[Sequence[int]],
    nsa_state_type: Any,
) -> Tuple[list, list]:
    """Per state type: NSA pairs filtered to this rank's owned pages, others unchanged."""
    src_out, dst_out = list(prefill_state_indices), list(dst_state_indices)
    for i, state_type in enumerate(state_types):
        if state_type != nsa_state_type or i >= len(src_out) or src_out[i] is None:
            continue
        dst = dst_out[i] if i < len(dst_out) else []
        src_out[i], filtered_dst = owned_state_pages(layout, src_out[i], dst)
        if i < len(dst_out):
            dst_out[i] = filtered_dst
    return src_out, dst_out


def maybe_send_extra_around(
    original: Callable,
    self: Any,
    req: Any,
    prefill_state_indices: List,
    executor: Any,
    target_rank_registration_info: Optional[Any] = None,
):
    """AROUND hook of ``MooncakeKVManager.maybe_send_extra``."""
    if not is_cp_shared_kv_enabled(self.server_args):
        return original(self, req, prefill_state_indices, executor, target_rank_registration_info)
    from sglang.srt.disaggregation.base.conn import StateType

    src, dst = filter_nsa_state_indices(
        layout_of_kv_manager(self),
        getattr(self.kv_args, "state_types", []),
        prefill_state_indices,
        req.dst_state_indices,
        StateType.NSA,
    )
    return original(
        self, dataclasses.replace(req, dst_state_indices=dst), src, executor, target_rank_registration_info
    )


def hisparse_token_transfer(
    page_positions: np.ndarray, src_pages: np.ndarray, num_dst_tokens: int, page_size: int
) -> Tuple[np.ndarray, np.ndarray]:
    """Token-level ``(source locs, destination token positions)`` of a page transfer whose
    destination is an index array of page positions (shared KV) instead of upstream's
    contiguous ``slice``; tokens past the request's last (partial) page are dropped."""
    offsets = np.arange(page_size, dtype=np.int64)
    dst_tokens = (np.asarray(page_positions, dtype=np.int64)[:, None] * page_size + offsets).ravel()
    src_tokens = (np.asarray(src_pages, dtype=np.int64)[:, None] * page_size + offsets).ravel()
    keep = dst_tokens < num_dst_tokens
    return src_tokens[keep], dst_tokens[keep]


def send_kvcache_hisparse_around(
    original: Callable,
    self: Any,
    mooncake_session_id: str,
    prefill_kv_indices: np.ndarray,
    dst_kv_ptrs: list,
    dst_kv_indices: np.ndarray,
    page_index_slice: Any,
    executor: Any,
):
    """AROUND hook of ``MooncakeKVManager.send_kvcache_hisparse`` (decode ``--enable-hisparse``).

    Upstream reads ``page_index_slice.start``; the shared-KV PD filter passes the owned
    pages' positions as an ndarray, so expand those positions to tokens here. Only that
    ndarray (the plugin's filter's product) takes this path: upstream's slice, or anything
    else a caller passes, is upstream's.
    """
    if not isinstance(page_index_slice, np.ndarray):
        return original(
            self, mooncake_session_id, prefill_kv_indices, dst_kv_ptrs, dst_kv_indices, page_index_slice, executor
        )
    page_size = self.kv_args.page_size
    src_tokens, dst_positions = hisparse_token_transfer(
        page_index_slice, prefill_kv_indices, len(dst_kv_indices), page_size
    )
    return self._send_kvcache_generic(
        mooncake_session_id=mooncake_session_id,
        src_data_ptrs=self.kv_args.kv_data_ptrs,
        dst_data_ptrs=dst_kv_ptrs,
        item_lens=[item_len // page_size for item_len in self.kv_args.kv_item_lens],
        prefill_data_indices=src_tokens.astype(np.int32),
        dst_data_indices=np.asarray(dst_kv_indices)[dst_positions],
        executor=executor,
    )
