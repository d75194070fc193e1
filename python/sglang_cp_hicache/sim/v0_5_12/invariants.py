"""One rank's memory accounting: what must hold between batches, and the final flush.

Starting free counts are taken when the stack is fresh; between batches (all acks in,
since CPU copies are synchronous) and after the flush, the pools must add up again.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, ContextManager, List, Optional, Sequence, Tuple

from sglang.srt.mem_cache.base_prefix_cache import EvictParams

from sglang_cp_hicache.sim.common_checks import check_lock_refs, pending_io
from sglang_cp_hicache.sim.engine import TreeSummary
from sglang_cp_hicache.testing.v0_5_12.nsa_stack import RankStack


class PoolLedger:
    """Free counts at start, current usage, and the checks built on them."""

    def __init__(
        self,
        stack: RankStack,
        rank: int,
        shared_kv: bool,
        violation: Callable[[str], None],
        writes_in_flight: bool = False,
    ) -> None:
        self.writes_in_flight = writes_in_flight  # write acks may land steps later
        self.cache = stack.cache
        self.allocator = stack.allocator
        self.req_pool = stack.req_to_token_pool
        self.controller = self.cache.cache_controller
        self.host_pool = self.controller.mem_pool_host
        self.draft_host = getattr(self.host_pool, "draft", None)  # the MTP draft's pools
        self.page_size = self.cache.page_size
        self.rank = rank
        self.shared_kv = shared_kv
        self.violation = violation
        self.device_capacity = self.allocator.available_size()
        self.start_lanes = self.lanes()
        self.start_host_free = self.host_free()
        self.start_draft_free = self.draft_free()
        self.start_req_slots = self.req_pool.available_size()

    # --------------------------------------------------------------- usage
    def lanes(self) -> Optional[List[int]]:
        return self.allocator.lane_available_pages().tolist() if self.shared_kv else None

    def device_lane_used(self) -> List[int]:
        """Used device pages per owner lane (CP only): free at start minus free now."""
        free = self.allocator.lane_free_pages()
        return [start - now for start, now in zip(self.start_lanes, free)]

    def host_lane_used(self) -> List[int]:
        """Used host pages per owner lane (CP only), from the replicated host table."""
        return self.controller.host_table.lane_used_pages()

    def host_free(self) -> int:
        return sum(entry.host_pool.available_size() for entry in self.host_pool.entries)

    def draft_free(self) -> int:
        """Free slots of the draft's host pools (0 without a draft)."""
        if self.draft_host is None:
            return 0
        return sum(entry.host_pool.available_size() for entry in self.draft_host.entries)

    def host_used_physical_tokens(self) -> int:
        return self.host_pool.size - self.host_pool.available_size()

    def host_used_logical_tokens(self) -> int:
        if self.shared_kv:
            return self.controller.host_table.used_logical_tokens()
        return self.host_used_physical_tokens()

    # -------------------------------------------------------------- checks
    def check_idle(self, running: Sequence[Any] = ()) -> None:
        """Between batches: nothing pending or locked but the writes in flight and the
        ``running`` (chunked, mid-prefill) requests' own locks, slots and unaligned tails;
        every pool adds up."""
        cache = self.cache
        writes = 0 if self.writes_in_flight else len(cache.ongoing_write_through)
        if pending_io(writes, len(cache.ongoing_load_back), self.violation):
            return
        self._check_locks(running)
        tails = sum(len(req.prefix_indices) - req.cache_protected_len for req in running)
        total = (
            self.allocator.available_size() + cache.evictable_size_ + cache.protected_size_ + tails
        )
        if total != self.device_capacity:
            self.violation(
                f"available + evictable + protected = {total}, device capacity is "
                f"{self.device_capacity}"
            )
        if self.req_pool.available_size() != self.start_req_slots - len(running):
            self.violation("req_to_token_pool slots leaked")
        if self.shared_kv:
            lane_used = self.controller.host_table.lane_used_pages()[self.rank]
            physical_used = self.start_host_free - self.host_free()
            if lane_used * self.page_size != physical_used:
                self.violation(
                    f"host lane accounting says {lane_used * self.page_size} owned slots, "
                    f"the physical host pool has {physical_used} in use"
                )
            draft_used = self.start_draft_free - self.draft_free()
            if self.draft_host is not None and draft_used != physical_used:
                self.violation(
                    f"the draft's host pools have {draft_used} slots in use, the target's "
                    f"{physical_used}: target and draft must hold the same slots"
                )

    def _check_locks(self, running: Sequence[Any]) -> None:
        """Each node's lock_ref equals the locks taken at or below it by the writes in
        flight (one on each write-through node) and the running requests (one on each
        request's last node)."""
        cache = self.cache
        # A per-layer reservation not yet claimed by its insert is in flight unlocked (None).
        holders = Counter(i for i, node in cache.ongoing_write_through.items() if node is not None)
        holders.update(req.last_node.id for req in running)
        if not holders:
            if cache.protected_size_ != 0:
                self.violation(f"{cache.protected_size_} tokens still locked between batches")
            return
        check_lock_refs(cache.root_node, holders, lambda node: node.lock_ref, self.violation)

    def reserved_host_tokens(self) -> int:
        """Logical host tokens reserved by backups not yet committed (not in the tree)."""
        return self.cache.reserved_host_tokens() if self.shared_kv else 0

    def check_tree(self, summary: TreeSummary) -> None:
        """The tree's device and host tokens match the pools' accounting."""
        device_tokens = self.cache.evictable_size_ + self.cache.protected_size_
        if summary.device_tokens != device_tokens:
            self.violation(
                f"tree holds {summary.device_tokens} device tokens, sizes say {device_tokens}"
            )
        host_tokens = self.host_used_logical_tokens() - self.reserved_host_tokens()
        if summary.host_tokens != host_tokens:
            self.violation(
                f"tree holds {summary.host_tokens} host tokens, host accounting says "
                f"{host_tokens} besides the pending reservations"
            )

    # --------------------------------------------------------------- flush
    def flush(self, cache_call: Callable[[], ContextManager]) -> Tuple[int, int, int]:
        """Evict all device, then all host cache through the tree; return the leaks
        (device slots, host slots, req slots). ``cache_call`` wraps the cache calls."""
        cache = self.cache
        with cache_call():
            cache.evict(EvictParams(num_tokens=self.device_capacity))
            cache.evict_host(self.host_pool.size * len(self.start_lanes or [1]))
        if cache.root_node.children:
            self.violation(f"{len(cache.root_node.children)} subtrees left after the flush")
        if cache.evictable_size_ or cache.protected_size_:
            self.violation(
                f"after flush: evictable {cache.evictable_size_}, "
                f"protected {cache.protected_size_}"
            )
        if self.shared_kv and self.lanes() != self.start_lanes:
            self.violation(f"owner lanes {self.lanes()} after flush, {self.start_lanes} at start")
        return (
            self.device_capacity - self.allocator.available_size(),
            self.start_host_free - self.host_free() + self.start_draft_free - self.draft_free(),
            self.start_req_slots - self.req_pool.available_size(),
        )
