"""Batch-level mapping from the batch's logical KV pages to a dense temporary buffer.

Built once per forward (never per layer) from the batch's logical pages, which every CP
rank sees identically, so every rank derives the same dense layout and the same
collective sizes without talking to the others. Dense pages, in order:

* page 0: padding (mirrors the pool's physical page 0);
* the batch's *prefix* pages (any page holding a cached-prefix token), grouped by owner
  rank, each group in logical order: owner ``r``'s pages form one contiguous range, so
  materialising them is one contiguous copy per owner; these come from the owners' shards;
* the pages holding only current-chunk tokens, filled from the current chunk's KV, which
  prefill CP has already gathered on every rank.

The logical pages come from the host snapshot ``alloc_for_extend`` took from the scheduler's
``req_to_token`` mirror and the batches carried to the forward (:func:`forward_logical_pages`,
no device read); without one (no CP HiRadixCache, hence no mirror) the batch's page-start
column of ``req_to_token`` is copied to the host, one device sync per forward, warned once.

Every distinct logical page appears once (requests sharing a prefix share its pages).
Remapping logical locs/pages to dense ones is elementwise on the device (``searchsorted``
over the sorted distinct pages, then a lookup): no host sync, and entries outside the
batch (stale ``req_to_token`` columns past a request's length) land on the padding page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

import numpy as np
import torch

from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout, ceil_div
from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR

logger = logging.getLogger(__name__)
_warned_page_column_read = False


def forward_logical_pages(forward_batch: Any, page_size: int) -> List[np.ndarray]:
    """Logical page ids of each request of an extend forward, in the batch's order.

    The host snapshot the batch carries (``LOGICAL_PAGES_ATTR``, taken by
    ``alloc_for_extend`` from the req_to_token host mirror), checked against the batch's
    lens; without one, :func:`read_request_logical_pages` (a device read, warned once).
    """
    seq_lens = [int(n) for n in forward_batch.seq_lens_cpu.tolist()]
    carried = getattr(forward_batch, LOGICAL_PAGES_ATTR, None)
    if carried is None:
        _warn_page_column_read_once()
        return read_request_logical_pages(
            forward_batch.req_to_token_pool.req_to_token, forward_batch.req_pool_indices, seq_lens, page_size
        )
    if carried.seq_lens != tuple(seq_lens):
        raise ValueError(
            f"CP shared KV: the forward batch's lens {seq_lens} are not those of the logical "
            f"pages alloc_for_extend took for it ({list(carried.seq_lens)}, req slots "
            f"{list(carried.req_pool_indices)})"
        )
    return list(carried.pages)


def _warn_page_column_read_once() -> None:
    global _warned_page_column_read
    if not _warned_page_column_read:
        _warned_page_column_read = True
        logger.warning(
            "CP shared KV: an extend forward carries no host snapshot of its logical pages, so "
            "its page mapping copies the batch's req_to_token page column to the host (one "
            "device sync per prefill forward). The snapshot comes from the req_to_token host "
            "mirror, which only the CP HiRadixCache keeps (--enable-hierarchical-cache); "
            "without HiCache, or for a batch changed after alloc_for_extend, this path is taken"
        )


def read_request_logical_pages(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens_cpu: Sequence[int],
    page_size: int,
) -> List[np.ndarray]:
    """Logical page ids of each request's pages ``0 .. ceil(seq_len / page_size) - 1``.

    One device->host copy of the page-start columns for the whole batch; call once per
    forward.
    """
    num_pages = [ceil_div(int(n), page_size) for n in seq_lens_cpu]
    max_pages = max(num_pages, default=0)
    if max_pages == 0:
        return [np.zeros(0, dtype=np.int64) for _ in num_pages]
    page_starts = req_to_token[req_pool_indices, : max_pages * page_size : page_size]
    host = (page_starts // page_size).to(torch.int64).cpu().numpy()
    return [host[i, :n] for i, n in enumerate(num_pages)]


@dataclass(frozen=True)
class OwnerPagePlan:
    """Prefix pages grouped by owner rank (host; identical on every rank).

    Owner ``r``'s pages, in logical order, are dense pages
    ``dense_starts[r] .. dense_starts[r] + len(owner_logical_pages[r]) - 1``.
    """

    owner_logical_pages: Tuple[np.ndarray, ...]
    dense_starts: Tuple[int, ...]

    @property
    def max_owned(self) -> int:
        return max((len(p) for p in self.owner_logical_pages), default=0)

    @property
    def num_prefix_pages(self) -> int:
        return sum(len(p) for p in self.owner_logical_pages)

    def dense_range(self, owner: int) -> slice:
        start = self.dense_starts[owner]
        return slice(start, start + len(self.owner_logical_pages[owner]))

    @property
    def prefix_dense_range(self) -> slice:
        return slice(1, 1 + self.num_prefix_pages)


@dataclass(frozen=True)
class CpSharedKVBatchMapping:
    """Dense layout of one forward batch's KV pages for one CP rank.

    Invariants: ``sorted_logical_pages`` is sorted and distinct and
    ``dense_of_sorted[i]`` is the dense page of its ``i``-th entry; ``num_dense_pages``
    counts the padding page; ``local_physical_pages`` are this rank's owned prefix pages,
    in the order of ``plan.dense_range(cp_rank)``.
    """

    layout: CpSharedKVLayout
    sorted_logical_pages: torch.Tensor
    dense_of_sorted: torch.Tensor
    num_dense_pages: int
    plan: OwnerPagePlan
    local_physical_pages: torch.Tensor

    @property
    def local_dense_range(self) -> slice:
        return self.plan.dense_range(self.layout.cp_rank)

    def remap_logical_pages(self, logical_pages: torch.Tensor) -> torch.Tensor:
        """Dense page of each logical page (0, the padding page, if not in the batch)."""
        if self.num_dense_pages == 1:
            return torch.zeros_like(logical_pages)
        pages = logical_pages.to(torch.int64)
        position = torch.searchsorted(self.sorted_logical_pages, pages).clamp(max=self.num_dense_pages - 2)
        found = self.sorted_logical_pages[position] == pages
        return torch.where(found, self.dense_of_sorted[position], 0).to(logical_pages.dtype)

    def remap_logical_locs(self, logical_locs: torch.Tensor) -> torch.Tensor:
        """Dense loc of each logical loc; the offset in the page is kept."""
        page_size = self.layout.page_size
        dense_pages = self.remap_logical_pages(logical_locs // page_size)
        return dense_pages * page_size + logical_locs % page_size


def build_batch_mapping(
    layout: CpSharedKVLayout,
    request_logical_pages: Sequence[np.ndarray],
    prefix_lens: Sequence[int],
    device: torch.device | str,
) -> CpSharedKVBatchMapping:
    """Mapping for a batch whose request ``i`` spans ``request_logical_pages[i]`` and has
    ``prefix_lens[i]`` cached tokens (host arrays; identical on every CP rank)."""
    empty = np.zeros(0, dtype=np.int64)
    pages = [np.asarray(p, dtype=np.int64) for p in request_logical_pages]
    sorted_logical = np.unique(np.concatenate(pages or [empty]))
    prefix_pages = np.unique(
        np.concatenate(
            [p[: ceil_div(int(n), layout.page_size)] for p, n in zip(pages, prefix_lens, strict=True)]
            or [empty]
        )
    )
    owners = layout.owner_for_logical_pages(prefix_pages)
    owner_pages = tuple(prefix_pages[owners == r] for r in range(layout.cp_size))
    counts = np.array([len(p) for p in owner_pages], dtype=np.int64)
    starts = 1 + np.concatenate([[0], np.cumsum(counts)[:-1]])
    # Dense order: prefix pages owner-major, then current-chunk-only pages.
    dense_order = np.concatenate(
        [*owner_pages, sorted_logical[~np.isin(sorted_logical, prefix_pages)]]
    ).astype(np.int64)
    dense_of_sorted = np.empty(len(sorted_logical), dtype=np.int64)
    dense_of_sorted[np.searchsorted(sorted_logical, dense_order)] = np.arange(1, len(dense_order) + 1)

    def on_device(values: np.ndarray) -> torch.Tensor:
        return torch.as_tensor(np.asarray(values, dtype=np.int64)).to(device, non_blocking=True)

    return CpSharedKVBatchMapping(
        layout=layout,
        sorted_logical_pages=on_device(sorted_logical),
        dense_of_sorted=on_device(dense_of_sorted),
        num_dense_pages=len(sorted_logical) + 1,
        plan=OwnerPagePlan(owner_logical_pages=owner_pages, dense_starts=tuple(int(x) for x in starts)),
        local_physical_pages=on_device(layout.logical_pages_to_physical(owner_pages[layout.cp_rank])),
    )
