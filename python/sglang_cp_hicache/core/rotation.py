"""The owner rule of CP shared KV, in one place (imports no SGLang).

Two page coordinates meet here, and their names keep them apart:

* a **logical page** (:data:`LogicalPage`): a logical slot's page, ``logical loc //
  page_size``, identical on every rank, for device slots and host slots alike. Its owner
  lane is ``logical_page % lanes`` (0.5.12.post1's ``CpSharedKVLayout``, 0.5.23's
  ``PageInterleavePoolAllocator`` and ``PageInterleaveHostPool``);
* a **position page** (:data:`PositionPage`): a page's index in its sequence, counted from
  the root (``token position // page_size``). Under 0.5.23's rotation a chain with base
  ``b`` lays position page ``P`` on lane ``(b + P) % lanes``, so a chain's pages cycle the
  lanes in order from its base.

An :data:`OwnerLane` is the CP rank that stores a page, in ``[0, lanes)``. Every function
accepts a Python int or an integer ``torch.Tensor`` / ``numpy.ndarray`` for its page
argument (elementwise, same kind back) and never syncs a device.
"""

from __future__ import annotations

from typing import Iterable, List, NewType, TypeVar

import numpy as np
import torch

#: A logical slot page (logical loc // page size): identical on every rank.
LogicalPage = NewType("LogicalPage", int)
#: A page's index in its sequence from the root (token position // page size).
PositionPage = NewType("PositionPage", int)
#: The CP rank that stores a page, in ``[0, lanes)``.
OwnerLane = NewType("OwnerLane", int)

Pages = TypeVar("Pages", int, torch.Tensor, np.ndarray)


def lane_of(logical_pages: Pages, lanes: int) -> Pages:
    """The owner lane of each logical page."""
    return logical_pages % lanes


def owner_of(base: int, position_pages: Pages, lanes: int) -> Pages:
    """The owner lane of each position page of a chain whose rotation base is ``base``."""
    return (base + position_pages) % lanes


def base_for(owner: int, position_page: int, lanes: int) -> OwnerLane:
    """The rotation base of the chain that lays ``position_page`` on lane ``owner``
    (:func:`owner_of`'s inverse: ``owner_of(base_for(o, p, n), p, n) == o % n``)."""
    return OwnerLane((owner - position_page) % lanes)


def run_lane_counts(start_lane: int, pages: int, lanes: int) -> List[int]:
    """Pages per lane of a run of ``pages`` consecutive position pages whose first page
    is on ``start_lane`` (taken mod ``lanes``): the run's ``k``-th page is on
    ``owner_of(start_lane, k, lanes)``."""
    full, rest = divmod(pages, lanes)
    start = start_lane % lanes
    return [full + (1 if (lane - start) % lanes < rest else 0) for lane in range(lanes)]


def lane_page_counts(logical_pages: Iterable[int], lanes: int) -> List[int]:
    """Pages per lane of any set of logical pages (:func:`lane_of` each, counted)."""
    counts = [0] * lanes
    for page in logical_pages:
        counts[page % lanes] += 1
    return counts


__all__ = [
    "LogicalPage",
    "OwnerLane",
    "PositionPage",
    "base_for",
    "lane_of",
    "lane_page_counts",
    "owner_of",
    "run_lane_counts",
]
