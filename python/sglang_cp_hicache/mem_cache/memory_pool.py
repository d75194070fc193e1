"""Host mirror of ``ReqToTokenPool`` for CP HiCache (extends ``sglang.srt.mem_cache.memory_pool``).

The backup and eviction planners need each radix node's logical device locs on the host
(:class:`PageRun`). Reading them back from ``node.value`` costs a device -> host copy (a
stream sync) per node on a GPU. The scheduler path allocates those locs on the host in the
first place (the CP allocator's lanes are NumPy), so this mirror keeps them there: row
``req_pool_idx``, column ``position`` holds the logical loc SGLang wrote into
``req_to_token`` at the same place.

Logical and replicated: every CP rank writes the same locs at the same places (the
allocator's placement does not depend on the rank), so no collective is ever needed.
"""

from __future__ import annotations

import numpy as np


class ReqToTokenHostMirror:
    """Logical device locs by (req slot, position), on the host; one job, no policy.

    Invariant (kept by the writers, checked by ``testing``/the simulator): for every
    position SGLang has written for a live request, ``row(req_pool_idx)[position] ==
    req_to_token[req_pool_idx, position]``. Stale rows of freed slots are never read: a
    new request writes its positions before anything reads them.

    ``int32`` like ``req_to_token``; ``np.zeros`` commits host memory only for the rows and
    positions requests actually touch.
    """

    def __init__(self, num_slots: int, max_context_len: int) -> None:
        self.locs = np.zeros((num_slots, max_context_len), dtype=np.int32)

    def row(self, req_pool_idx: int) -> np.ndarray:
        """A view of one request's row (positions index it)."""
        return self.locs[req_pool_idx]

    def read(self, req_pool_idx: int, start: int, end: int) -> np.ndarray:
        """Positions ``[start, end)`` of a request, as a new host int64 array."""
        return self.locs[req_pool_idx, start:end].astype(np.int64)

    def write(self, req_pool_idx: int, start: int, logical_locs: np.ndarray) -> None:
        """Positions ``[start, start + len(logical_locs))`` of a request."""
        self.locs[req_pool_idx, start : start + len(logical_locs)] = logical_locs

    def gather(self, req_pool_indices: np.ndarray, positions: np.ndarray) -> np.ndarray:
        """One position per request (host int64)."""
        return self.locs[req_pool_indices, positions].astype(np.int64)

    def scatter(
        self, req_pool_indices: np.ndarray, positions: np.ndarray, logical_locs: np.ndarray
    ) -> None:
        """One position per request."""
        self.locs[req_pool_indices, positions] = logical_locs
