"""The batch's host page snapshot, from ``ModelWorkerBatch`` to ``ForwardBatch`` (extends
``sglang.srt.model_executor.forward_batch_info``).

``ForwardBatch.init_new`` (AROUND) copies the :class:`BatchLogicalPages` that
``get_model_worker_batch`` carried (``managers/schedule_batch.py``) onto the forward batch,
where the shared-KV page mapping reads it instead of ``req_to_token``. Both batches list the
requests in the same order (``init_new`` takes ``req_pool_indices`` and ``seq_lens`` from the
worker batch unchanged). Every forward batch ``init_new`` builds says what it carries: the
plugin's own snapshot (by type, read from the worker batch instance) or None, so a forward
batch built from any other batch (flag off, a ``MagicMock`` of upstream's tests) carries none.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.v0_5_12.mem_cache.memory_pool import LOGICAL_PAGES_ATTR, BatchLogicalPages
from sglang_cp_hicache.v0_5_12.own_objects import plugin_attr


def init_new_around(original: Callable, cls: Any, batch: Any, model_runner: Any) -> Any:
    """AROUND hook of the classmethod ``ForwardBatch.init_new``."""
    forward_batch = original(cls, batch, model_runner)
    snapshot = plugin_attr(batch, LOGICAL_PAGES_ATTR)
    setattr(forward_batch, LOGICAL_PAGES_ATTR, snapshot if isinstance(snapshot, BatchLogicalPages) else None)
    return forward_batch
