"""Hooks on SGLang's ``ScheduleBatch`` (extends ``sglang.srt.managers.schedule_batch``).

``prepare_for_extend_after``: once a prefill batch's KV slots are allocated and its
``req_to_token`` rows written, the cache reserves host pages for the leaves the batch's
inserts will create (:meth:`CpHiRadixCache.reserve_for_extend`), so their D2H can be
submitted during the forward. Only the plugin's CP-mode cache reserves (by type); any other
cache (flag off, a ``MagicMock`` of upstream's tests) is upstream's path.

``get_model_worker_batch_around``: the batch's host page snapshot goes from
``ScheduleBatch`` to ``ModelWorkerBatch``. ``alloc_for_extend`` (``mem_cache/common.py``)
leaves on the ``ScheduleBatch`` the logical page ids of its requests
(:class:`BatchLogicalPages`, host); it is handed on only when the batch still holds the
requests it was taken for, in the same order and with the same lens; a batch merged,
filtered or mixed with running requests since (its ``req_pool_indices`` no longer those of
the allocation) carries none, and its forward falls back to reading ``req_to_token``. The
snapshot is recognised by its type, read from the batch instance (:func:`plugin_attr`): a
foreign batch answering every name carries nothing.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR, BatchLogicalPages
from sglang_cp_hicache.v0_5_12.own_objects import cp_hicache_of, plugin_attr


def prepare_for_extend_after(result: Any, self: Any) -> None:
    cache = cp_hicache_of(self.tree_cache)
    if cache is None:
        return None
    for req in self.reqs:
        cache.reserve_for_extend(req)
    return None


def get_model_worker_batch_around(original: Callable, self: Any, *args, **kwargs) -> Any:
    """AROUND hook of ``ScheduleBatch.get_model_worker_batch``."""
    worker_batch = original(self, *args, **kwargs)
    snapshot = plugin_attr(self, LOGICAL_PAGES_ATTR)
    if not isinstance(snapshot, BatchLogicalPages) or not worker_batch.forward_mode.is_extend():
        return worker_batch  # e.g. the prefill batch object decoding on as the running batch
    seq_lens_cpu = worker_batch.seq_lens_cpu  # a host tensor
    if seq_lens_cpu is not None and snapshot.taken_for(
        [req.req_pool_idx for req in self.reqs], seq_lens_cpu.tolist()
    ):
        setattr(worker_batch, LOGICAL_PAGES_ATTR, snapshot)
    return worker_batch
