"""Mooncake's NSA state transfer (indexer K/scale pages) under CP shared KV.

``MooncakeKVManager.maybe_send_extra`` pairs the request's logical NSA state pages with the
decode side's pages position by position and sends all of them. Under shared KV a rank
holds only its owned pages, so the hook keeps the owned pairs, with physical source ids
(see :mod:`sglang_cp_hicache.disaggregation.utils`). Other state types pass through.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, List, Optional, Sequence, Tuple

import numpy as np

from sglang_cp_hicache.disaggregation.utils import layout_of_kv_manager, owned_pages_for_transfer
from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.server_args import is_cp_shared_kv_enabled


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
