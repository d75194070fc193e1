"""One 0.5.23 rank's memory accounting: what must hold between batches, and the final flush.

Lanes: under sharding, owner class ``r`` of the ``PageInterleavePoolAllocator`` (device)
and of the ``PageInterleaveHostPool``'s slots (host) is rank ``r``'s physical pool; every
rank holds the same (logical, replicated) view of all lanes. Unsharded, one lane.
Starting free counts are taken when the stack is fresh; between batches (acks in, as the
CPU runtime's copies are synchronous) and after the flush, the pools must add up again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, ContextManager, List, Sequence, Tuple

from sglang_cp_hicache.sim.common_checks import check_lock_refs, pending_io
from sglang_cp_hicache.sim.engine import TreeSummary
from sglang_cp_hicache.testing.v0_5_23.stack import RankStack


class PoolLedger:
    """Free counts at start, current usage, and the checks built on them."""

    def __init__(
        self, stack: RankStack, violation: Callable[[str], None], writes_in_flight: bool = False
    ) -> None:
        self.stack = stack
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.req_pool = stack.req_to_token_pool
        self.page_size = stack.config.page_size
        self.violation = violation
        self.writes_in_flight = writes_in_flight  # write acks may land steps later
        self.start_device_lanes = self.device_lane_free()
        self.start_host_lanes = self.host_lane_free()
        self.device_capacity = self.device_free_tokens()
        self.host_capacity = self.host_free_tokens()
        self.start_req_slots = self.req_pool.available_size()

    # --------------------------------------------------------------- usage
    def device_lane_free(self) -> List[int]:
        """Free device pages per owner lane (one lane unsharded)."""
        if self.stack.sharded:
            return self.allocator.class_free_page_counts()
        return [self.allocator.available_size() // self.page_size]

    def host_lane_free(self) -> List[int]:
        """Free host pages per owner lane: the sharded host pool keeps its slots in the
        device's classed allocator (``PageInterleaveHostPool._slots``, read-only here)."""
        host = self.stack.kv_host_pool
        if self.stack.sharded:
            return host._slots.class_free_page_counts()
        return [host.available_size() // self.page_size]

    def device_lane_used(self) -> List[int]:
        return [start - now for start, now in zip(self.start_device_lanes, self.device_lane_free())]

    def host_lane_used(self) -> List[int]:
        return [start - now for start, now in zip(self.start_host_lanes, self.host_lane_free())]

    def device_free_tokens(self) -> int:
        """Free logical device slots over all lanes (not the min-class admission floor)."""
        return sum(self.device_lane_free()) * self.page_size

    def host_free_tokens(self) -> int:
        return sum(self.host_lane_free()) * self.page_size

    def host_used_logical_tokens(self) -> int:
        return self.host_capacity - self.host_free_tokens()

    def host_used_physical_tokens(self) -> int:
        """Host rows this rank holds: its own lane (every lane's token on cp 1)."""
        return self.host_lane_used()[self.stack.shard_rank] * self.page_size

    # -------------------------------------------------------------- checks
    def check_idle(self, running: Sequence[Any] = ()) -> None:
        """Between batches: nothing pending or locked but the writes in flight and the
        ``running`` (chunked, mid-prefill) requests' own locks, rows and private pages;
        every pool adds up."""
        cache = self.cache
        writes = 0 if self.writes_in_flight else len(cache.ongoing_write_through)
        if pending_io(writes, len(cache.ongoing_load_back), self.violation):
            return
        self._check_locks(running)
        ps = self.page_size
        # A running request's pages past its tree-protected prefix are its own (whole pages).
        private = sum(
            -(-req.kv.kv_allocated_len // ps) * ps - req.kv.cache_protected_len for req in running
        )
        in_tree = cache.evictable_size() + cache.protected_size()
        total = self.device_free_tokens() + in_tree + private
        if total != self.device_capacity:
            self.violation(
                f"free + evictable + protected + private = {total}, device capacity is "
                f"{self.device_capacity}"
            )
        if self.req_pool.available_size() != self.start_req_slots - len(running):
            self.violation("req_to_token_pool slots leaked")

    def _check_locks(self, running: Sequence[Any]) -> None:
        """Each node's FULL lock_ref equals the locks taken at or below it by the writes in
        flight and the running requests (a lock covers its node's path to the root)."""
        from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

        cache = self.cache
        writes = cache.ongoing_write_through.values()
        holders = Counter(w.node_id for w in writes if w.lock_params is not None)
        holders.update(req.lock.node for req in running if req.lock is not None)
        check_lock_refs(
            cache.tree_core.root_node,
            holders,
            lambda node: node.component_data[ComponentType.FULL].lock_ref,
            self.violation,
        )

    def check_tree(self, summary: TreeSummary) -> None:
        """The tree's device and host tokens match the pools' accounting."""
        device_tokens = self.cache.evictable_size() + self.cache.protected_size()
        if summary.device_tokens != device_tokens:
            self.violation(
                f"tree holds {summary.device_tokens} device tokens, sizes say {device_tokens}"
            )
        host_tokens = self.host_used_logical_tokens()
        if summary.host_tokens != host_tokens:
            self.violation(
                f"tree holds {summary.host_tokens} host tokens, the host pool {host_tokens} in use"
            )

    # --------------------------------------------------------------- flush
    def flush(self, cache_call: Callable[[], ContextManager]) -> Tuple[int, int, int]:
        """Evict all device, then all host cache through the tree; return the leaks
        (device slots, host slots, req slots). ``cache_call`` wraps the cache calls."""
        from sglang.srt.mem_cache.base_prefix_cache import EvictParams

        cache = self.cache
        with cache_call():
            cache.evict(EvictParams(num_tokens=self.device_capacity))
            cache.evict_host(self.host_capacity)
        root = cache.tree_core.root_node
        if root.children:
            self.violation(f"{len(root.children)} subtrees left after the flush")
        if cache.evictable_size() or cache.protected_size():
            self.violation(
                f"after flush: evictable {cache.evictable_size()}, protected {cache.protected_size()}"
            )
        for tier, now, start in (
            ("device", self.device_lane_free(), self.start_device_lanes),
            ("host", self.host_lane_free(), self.start_host_lanes),
        ):
            if now != start:
                self.violation(f"{tier} lanes {now} free after flush, {start} at start")
        return (
            self.device_capacity - self.device_free_tokens(),
            self.host_capacity - self.host_free_tokens(),
            self.start_req_slots - self.req_pool.available_size(),
        )
