"""Page-granular ownership of logical KV locs under NSA prefill CP shared KV.

The scheduler, radix tree and ``req_to_token`` use *logical* locs that are identical on
every CP rank. Each rank's device KV pool stores only the pages it owns:

* ``owner(logical_page) = logical_page % cp_size``
* ``physical_page = logical_page // cp_size`` (on the owner rank)
* ``physical_loc = physical_page * page_size + offset_in_page``
* inverse on rank ``r``: ``logical_page = physical_page * cp_size + r``

Physical page 0 is SGLang's reserved padding page on every rank, so logical pages
``0 .. cp_size - 1`` are never handed out by the allocator. A token this rank does not own
is written to the same offset of that padding page (:meth:`CpSharedKVLayout.physical_write_locs`),
which no reader ever addresses.

This module is the one place of device-side translation (owner, physical loc, padding
page); the host tier has its own translator, ``CpHostPageTable``. Every method accepts a
``torch.Tensor`` or a ``numpy.ndarray`` of non-negative integers and returns the same
kind, with identical values either way.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional, Sequence, TypeVar, Union

import numpy as np
import torch

from sglang_cp_hicache.core.rotation import lane_of

IndexArray = TypeVar("IndexArray", torch.Tensor, np.ndarray)
AnyIndexArray = Union[torch.Tensor, np.ndarray]


def _is_host_resident(values: AnyIndexArray) -> bool:
    return isinstance(values, np.ndarray) or values.device.type == "cpu"


def host_int64(values: Union[torch.Tensor, np.ndarray, Sequence[int]]) -> np.ndarray:
    """Flat host int64 array of lens, owners or locs: a view of a CPU int64 tensor or
    array (radix values and CPU lens already are), a converted copy of anything else.

    A CUDA tensor is copied to the host here (a stream sync): callers on the scheduler
    path pass host-resident values.
    """
    if isinstance(values, torch.Tensor):
        if values.is_cpu and values.dtype is torch.int64:
            return values.numpy().reshape(-1)
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=np.int64).reshape(-1)


def ceil_div(values: IndexArray, divisor: int) -> IndexArray:
    return (values + divisor - 1) // divisor


@functools.lru_cache(maxsize=None)
def page_offsets(page_size: int) -> np.ndarray:
    """``arange(page_size)`` as a read-only int64 array, built once per page size (the hot
    paths expand a page or two per call, where building it would be a fair share)."""
    offsets = np.arange(page_size, dtype=np.int64)
    offsets.flags.writeable = False
    return offsets


def page_token_locs(pages: IndexArray, page_size: int) -> IndexArray:
    """Token locs covering whole pages, page by page (same kind and device as ``pages``)."""
    if isinstance(pages, np.ndarray):
        if len(pages) == 1:
            # The usual node: one arange, far cheaper than a broadcast when the caches are
            # cold (as on the scheduler thread between tree walks).
            start = pages.item() * page_size
            return np.arange(start, start + page_size, dtype=pages.dtype)
        if pages.dtype == np.int64:
            return (pages[:, None] * page_size + page_offsets(page_size)).reshape(-1)
        offsets = np.arange(page_size, dtype=pages.dtype)
        return (pages[:, None] * page_size + offsets).reshape(-1)
    offsets = torch.arange(page_size, dtype=pages.dtype, device=pages.device)
    return (pages.unsqueeze(1) * page_size + offsets).reshape(-1)


def _nonzero_positions(mask: IndexArray) -> IndexArray:
    if isinstance(mask, np.ndarray):
        return np.flatnonzero(mask).astype(np.int64)
    return torch.nonzero(mask.reshape(-1), as_tuple=True)[0]


@dataclass(frozen=True)
class CpSharedKVLayout:
    """Maps logical KV locs/pages of a CP group onto one rank's physical pool."""

    cp_size: int
    cp_rank: int
    page_size: int

    def __post_init__(self) -> None:
        if self.cp_size < 1:
            raise ValueError(f"cp_size must be >= 1, got {self.cp_size}")
        if not 0 <= self.cp_rank < self.cp_size:
            raise ValueError(f"cp_rank must be in [0, {self.cp_size}), got {self.cp_rank}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")

    # ----------------------------------------------------------------- ownership
    def owner_for_logical_pages(self, logical_pages: IndexArray) -> IndexArray:
        """CP rank that stores each logical page."""
        return lane_of(logical_pages, self.cp_size)

    def owner_for_logical_locs(self, logical_locs: IndexArray) -> IndexArray:
        """CP rank that stores each logical token loc."""
        return self.owner_for_logical_pages(logical_locs // self.page_size)

    def page_owners_of_locs(self, logical_locs: IndexArray) -> IndexArray:
        """Owner of each page of a page-aligned logical loc run.

        ``logical_locs`` must start at a page boundary and list each page's tokens
        contiguously (a radix node value or an ``alloc`` result); the owner of page ``i``
        is read from its first token ``logical_locs[i * page_size]``. A trailing partial
        page counts as a page.
        """
        return self.owner_for_logical_locs(logical_locs[:: self.page_size])

    def owned_mask(self, logical_locs: IndexArray) -> IndexArray:
        """Boolean mask of the locs stored on this rank."""
        return self.owner_for_logical_locs(logical_locs) == self.cp_rank

    def owned_positions(self, logical_locs: IndexArray) -> IndexArray:
        """int64 indices into ``logical_locs`` of the entries stored on this rank."""
        return _nonzero_positions(self.owned_mask(logical_locs))

    # ------------------------------------------------------- logical -> physical
    def logical_pages_to_physical(
        self, owned_logical_pages: IndexArray, validate: Optional[bool] = None
    ) -> IndexArray:
        """Physical page of each owned logical page.

        ``validate``: raise ``ValueError`` if any page is not owned by this rank. ``None``
        (default) validates only host-resident input (NumPy or CPU tensor), because the
        check on a device tensor is a host sync; pass ``True`` to force it there.
        """
        if self._should_validate(owned_logical_pages, validate):
            self._raise_if_not_owned(self.owner_for_logical_pages(owned_logical_pages), "page")
        return owned_logical_pages // self.cp_size

    def logical_locs_to_physical(
        self, owned_logical_locs: IndexArray, validate: Optional[bool] = None
    ) -> IndexArray:
        """Physical loc of each owned logical loc (same ``validate`` rule as pages)."""
        logical_pages = owned_logical_locs // self.page_size
        if self._should_validate(owned_logical_locs, validate):
            self._raise_if_not_owned(self.owner_for_logical_pages(logical_pages), "loc")
        offsets = owned_logical_locs - logical_pages * self.page_size
        return (logical_pages // self.cp_size) * self.page_size + offsets

    def physical_write_locs(self, logical_locs: IndexArray) -> IndexArray:
        """Where a forward writes each logical loc on this rank: its physical loc when this
        rank owns it, else the same offset of the padding page 0 (same dtype; elementwise,
        no host sync, no data-dependent shape)."""
        offsets = logical_locs % self.page_size
        logical_pages = logical_locs // self.page_size
        owned = self.owner_for_logical_pages(logical_pages) == self.cp_rank
        physical = self.logical_pages_to_physical(logical_pages, validate=False) * self.page_size + offsets
        if isinstance(logical_locs, np.ndarray):
            return np.where(owned, physical, offsets)
        return torch.where(owned, physical, offsets)

    # ------------------------------------------------------- physical -> logical
    def physical_pages_to_logical(self, physical_pages: IndexArray) -> IndexArray:
        """Logical page stored in each physical page of this rank."""
        return self.owner_lane_pages(physical_pages, self.cp_rank)

    def owner_lane_pages(self, physical_pages: IndexArray, owner: int) -> IndexArray:
        """Logical page stored in each physical page of rank ``owner`` (its owner lane)."""
        return physical_pages * self.cp_size + owner

    def physical_locs_to_logical(self, physical_locs: IndexArray) -> IndexArray:
        """Logical loc stored in each physical loc of this rank."""
        physical_pages = physical_locs // self.page_size
        offsets = physical_locs - physical_pages * self.page_size
        return self.physical_pages_to_logical(physical_pages) * self.page_size + offsets

    # ------------------------------------------------------------------ helpers
    @staticmethod
    def _should_validate(values: AnyIndexArray, validate: Optional[bool]) -> bool:
        if validate is None:
            return _is_host_resident(values)
        return validate

    def _raise_if_not_owned(self, owners: AnyIndexArray, unit: str) -> None:
        not_owned = owners != self.cp_rank
        if bool(not_owned.any()):
            first = int(_nonzero_positions(not_owned)[0])
            raise ValueError(
                f"logical {unit} at position {first} is owned by CP rank "
                f"{int(owners.reshape(-1)[first])}, not by rank {self.cp_rank} "
                f"(cp_size={self.cp_size}, page_size={self.page_size})"
            )
