"""Hook on SGLang's ``ScheduleBatch`` (``sglang.srt.managers.schedule_batch``).

``prepare_for_extend_after``: once a prefill batch's KV slots are allocated and its
``req_to_token`` rows written, the cache reserves host pages for the leaves the batch's
inserts will create (:meth:`CpHiRadixCache.reserve_for_extend`), so their D2H can be
submitted during the forward. Caches without the method (flag off) are upstream's path.
"""

from __future__ import annotations

from typing import Any


def prepare_for_extend_after(result: Any, self: Any) -> None:
    reserve = getattr(self.tree_cache, "reserve_for_extend", None)
    if reserve is None:
        return None
    for req in self.reqs:
        reserve(req)
    return None
