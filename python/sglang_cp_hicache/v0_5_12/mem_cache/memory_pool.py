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

from dataclasses import dataclass
from typing import Sequence, Tuple

import numpy as np

from sglang_cp_hicache.core.cp_shared_kv_layout import ceil_div

# The attribute a ScheduleBatch, ModelWorkerBatch and ForwardBatch carry it in.
LOGICAL_PAGES_ATTR = "cp_logical_pages_host"


@dataclass(frozen=True)
class BatchLogicalPages:
    """An extend batch's logical page ids, host int64, as its ``req_to_token`` rows were
    when ``alloc_for_extend`` wrote them (the rows its forward reads).

    Invariant: ``pages[i]`` are the ids of request ``i``'s pages ``0 ..
    ceil(seq_lens[i] / page_size) - 1`` (page-start loc ``// page_size``), request ``i``
    being the one in req slot ``req_pool_indices[i]``, in the batch's request order.
    """

    req_pool_indices: Tuple[int, ...]
    seq_lens: Tuple[int, ...]
    pages: Tuple[np.ndarray, ...]

    def taken_for(self, req_pool_indices: Sequence[int], seq_lens: Sequence[int]) -> bool:
        """True when a batch with these slots and lens, in this order, is the one it was
        taken for (a batch merged, filtered or re-allocated since is not)."""
        # Element-wise ==: a request without a slot (None) matches none.
        return self.req_pool_indices == tuple(req_pool_indices) and self.seq_lens == tuple(seq_lens)


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

    def batch_logical_pages(
        self, req_pool_indices: Sequence[int], seq_lens: Sequence[int], page_size: int
    ) -> BatchLogicalPages:
        """A snapshot (copies) of each request's page ids, in the order given."""
        pages = tuple(
            self.locs[slot, : ceil_div(int(n), page_size) * page_size : page_size].astype(np.int64) // page_size
            for slot, n in zip(req_pool_indices, seq_lens, strict=True)
        )
        return BatchLogicalPages(
            req_pool_indices=tuple(int(i) for i in req_pool_indices),
            seq_lens=tuple(int(n) for n in seq_lens),
            pages=pages,
        )
