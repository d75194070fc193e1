"""The 0.5.12.post1 driver's admission rules: what SGLang's ``PrefillAdder`` decides of a
request before it is admitted (its token budget, one chunked request at a time, the chunk
it runs). Pure decisions over the cache's replicated counters: identical on every rank."""

from __future__ import annotations

from typing import Any, Sequence

from sglang_cp_hicache.sim.v0_5_12.sim_req import SimReq


class PrefillBudget:
    """``PrefillAdder``'s checks over one rank's cache, allocator and request pool.

    ``lanes``: the owner lanes one page of slack is kept on (1 without CP shared KV);
    ``chunked_prefill_size``: new tokens per request per step (0: no chunking)."""

    def __init__(
        self, cache: Any, allocator: Any, req_pool: Any, page_size: int, lanes: int, chunked_prefill_size: int
    ) -> None:
        self.cache = cache
        self.allocator = allocator
        self.req_pool = req_pool
        self.page_size = page_size
        self.lanes = lanes
        self.chunked_prefill_size = chunked_prefill_size

    def fits(self, planned: Sequence[SimReq], req: SimReq, chunked: Sequence[SimReq]) -> bool:
        """PrefillAdder's token budget: the batch's new pages fit in free plus evictable
        device memory (locked pages, e.g. of writes in flight, do not count), with one page
        per owner lane of slack. Without it a request waits, as upstream's NO_TOKEN; so
        does one without a free request slot (upstream's running-request limit).
        ``chunked``: the requests mid-chunk that wait for a later step."""
        new_slots = sum(1 for other in (*planned, req) if other.req_pool_idx is None)
        if new_slots > self.req_pool.available_size():
            return False
        budget = self.allocator.available_size() + self.cache.evictable_size()
        budget -= self.page_size * self.lanes
        budget -= self._lock_cost(req.last_node)  # admission locks its device prefix
        for other in (*planned, req):
            # Not yet admitted (req): its host hit still needs device pages for the load.
            host_hit = other.host_hit_length if other is req else 0
            end = self.chunk_end(other, len(other.prefix_indices) + host_hit)
            new_tokens = end - len(other.prefix_indices)
            budget -= -(-new_tokens // self.page_size) * self.page_size
        return budget >= 0 or not (planned or self.cache.ongoing_write_through or chunked)

    def second_chunked(self, planned: Sequence[SimReq], req: SimReq, chunked: Sequence[SimReq]) -> bool:
        """Upstream runs one chunked request at a time: another one that needs chunking
        waits (PrefillAdder with ``has_chunked_req``)."""
        if not self._chunks_left(req, len(req.prefix_indices) + req.host_hit_length):
            return False
        planned_chunked = (o for o in planned if self._chunks_left(o, len(o.prefix_indices)))
        return any(True for _ in planned_chunked) or bool(chunked)

    def chunk_end(self, req: SimReq, start: int) -> int:
        """PrefillAdder's chunking: at most ``chunked_prefill_size`` new tokens per step."""
        size = self.chunked_prefill_size
        return len(req.prompt) if size == 0 else min(len(req.prompt), start + size)

    def _chunks_left(self, req: SimReq, start: int) -> bool:
        return self.chunk_end(req, start) < len(req.prompt)

    def _lock_cost(self, node: Any) -> int:
        """Evictable tokens that locking ``node`` (and so its ancestors) takes away."""
        cost = 0
        while node is not self.cache.root_node:
            if node.lock_ref == 0:
                cost += len(node.key)
            node = node.parent
        return cost


__all__ = ["PrefillBudget"]
