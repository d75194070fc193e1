"""Hook on SGLang's ``PrefillAdder`` (``sglang.srt.managers.schedule_policy``).

``add_one_req_around``: a request whose prefix match stopped above a node it would have
split, because that node's host backup is pending (not host-visible until its final ack),
is not added to this prefill batch: it stays in the waiting queue, holding no lock, and is
matched again next round, after that round's write acks (``check_hicache_events`` starts
each round). Other requests, and the pending backup itself, are untouched; the transfer is
never drained. Caches without deferrals (flag off, other cache classes) are upstream's path.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang.srt.managers.schedule_policy import AddReqResult


def add_one_req_around(original: Callable, self: Any, req: Any, *args, **kwargs) -> Any:
    take_deferral = getattr(self.tree_cache, "take_split_deferral", None)
    if take_deferral is not None and take_deferral(req):
        return AddReqResult.CONTINUE  # not in can_run_list: the scheduler keeps it waiting
    return original(self, req, *args, **kwargs)
