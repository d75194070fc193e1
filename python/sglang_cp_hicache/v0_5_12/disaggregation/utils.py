"""Owner-aware KV page filter for PD transfer under CP shared KV.

Upstream (``SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER=1``) splits a request's pages into
one contiguous range per CP rank, assuming every rank holds every page. Under shared KV
only a page's owner holds it, at its physical page id, so each CP rank sends exactly the
pages it owns, from their physical ids, into the decode slots of their positions:

* every page of the request is sent exactly once, by ``owner = logical_page % cp_size``;
* the source id is ``logical_page // cp_size`` (the owner's physical page);
* the destination is the decode page at the page's position in the request, so the
  decode side receives the full logical KV.

The filtered destination is an index array into the decode side's page list rather than a
contiguous ``slice``; Mooncake's MLA path indexes ``dst_kv_indices[index_slice]``, which
accepts both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Tuple, Union

import numpy as np

from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout
from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled

DstSelector = Union[slice, np.ndarray]


@dataclass(frozen=True)
class OwnedPageTransfer:
    """This rank's share of a page transfer: source pages and destination positions.

    Invariant: ``len(physical_pages) == len(dst_positions)``; positions are increasing.
    """

    physical_pages: np.ndarray
    dst_positions: np.ndarray


def owned_pages_for_transfer(
    layout: CpSharedKVLayout, logical_pages: np.ndarray, first_position: int = 0
) -> OwnedPageTransfer:
    """The pages of ``logical_pages`` this rank owns, as physical ids, and their positions
    (offset by ``first_position``) in the destination page list."""
    logical_pages = np.asarray(logical_pages)
    positions = np.flatnonzero(layout.owner_for_logical_pages(logical_pages) == layout.cp_rank)
    physical = layout.logical_pages_to_physical(logical_pages[positions])
    return OwnedPageTransfer(
        physical_pages=physical.astype(logical_pages.dtype, copy=False),
        dst_positions=positions + first_position,
    )


def layout_of_kv_manager(kv_mgr: Any) -> CpSharedKVLayout:
    return CpSharedKVLayout(kv_mgr.attn_cp_size, kv_mgr.attn_cp_rank, kv_mgr.kv_args.page_size)


def filter_kv_indices_for_shared_kv(
    layout: CpSharedKVLayout, kv_indices: np.ndarray, index_slice: slice
) -> Tuple[np.ndarray, np.ndarray]:
    """Shared-KV replacement of upstream ``filter_kv_indices_for_cp_rank``'s result."""
    share = owned_pages_for_transfer(layout, kv_indices, index_slice.start)
    return share.physical_pages, share.dst_positions


def filter_kv_indices_for_cp_rank_around(
    original: Callable, kv_mgr: Any, kv_indices: np.ndarray, index_slice: slice
) -> Tuple[np.ndarray, DstSelector]:
    """AROUND hook of ``sglang.srt.disaggregation.utils.filter_kv_indices_for_cp_rank``."""
    if not is_cp_shared_kv_enabled(kv_mgr.server_args):
        return original(kv_mgr, kv_indices, index_slice)
    return filter_kv_indices_for_shared_kv(layout_of_kv_manager(kv_mgr), kv_indices, index_slice)
