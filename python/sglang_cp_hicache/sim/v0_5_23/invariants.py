"""One 0.5.23 rank's memory accounting: what must hold between batches, and the final flush;
with per-layer D2H backup, its contract (:class:`LayerBackupLedger`).

Lanes: under sharding, owner class ``r`` of the ``PageInterleavePoolAllocator`` (device)
and of the ``PageInterleaveHostPool``'s slots (host) is rank ``r``'s physical pool; every
rank holds the same (logical, replicated) view of all lanes. Unsharded, one lane.
Starting free counts are taken when the stack is fresh; between batches (acks in, as the
CPU runtime's copies are synchronous) and after the flush, the pools must add up again.
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter
from typing import Any, Callable, ContextManager, Dict, Iterator, List, Sequence, Set, Tuple

from sglang_cp_hicache.sim.common_checks import check_lock_refs, pending_io
from sglang_cp_hicache.sim.engine import TreeSummary
from sglang_cp_hicache.testing.v0_5_23.rank_stack import RankStack


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


class LayerBackupLedger:
    """The per-layer D2H backup contract on one rank (``v0_5_23/backup/layer_backup.py``),
    observed at the backup's own seams (instance wrappers that count, never decide):

    * a forward that carries reserved backups reports every layer to the backup and appends
      exactly one write ack, after its last layer (none before it), on every rank, a rank
      owning none of the pages too: the counters are replicated, so the cross-rank check
      compares them;
    * a node that claimed reserved host slots stays write-through pending and device-locked
      (not host-visible) until its ticket's ack, and is published at that ack;
    * every reservation is claimed by its insert or settled (checkpoint, release) in its own
      batch, and one left unclaimed is rolled back; with no write in flight no ticket is left;
    * with L3 storage, no page goes to L3 before its per-layer backup's ack: a storage write
      (``controller.write_storage``, every L3 write's one door) may not name host slots of a
      backup still in flight (its last layer may not have reached the host). Storage writes
      of slots an acked per-layer backup filled are counted (``per_layer_l3_writes``,
      replicated: the write is issued on every rank, each rank's thread writes its pages).

    ``layer_num`` is the stack's (not the pipeline's): an ack the pipeline appends early
    is caught. With an MTP draft, :meth:`forward` spans the target's and the draft's
    forward, and the one ack must come after the draft's layer: none at a target layer.
    """

    def __init__(
        self,
        backup: Any,
        stack: RankStack,
        counters: Any,
        violation: Callable[[str], None],
        untimed: Callable[[], ContextManager] = contextlib.nullcontext,
    ) -> None:
        self.backup = backup
        self.untimed = untimed  # this ledger's records are no scheduler operation's time
        self.cache = stack.cache
        self.ack_queue = stack.controller.ack_write_queue
        self.layer_num = stack.config.layer_num
        self.counters = counters
        self.violation = violation
        self._claimed: Dict[int, int] = {}  # ticket -> node id, claimed before its ack
        self._committed: List[int] = []  # node ids whose ack committed them since the last check
        self._forward_tickets: List[int] = []  # held by the running forward
        self._forward_layers = 0
        self._unacked_slots: Dict[int, Set[int]] = {}  # ticket -> its host slots, until its ack
        self._acked_slots: Set[int] = set()  # host slots acked per-layer backups filled
        _wrap(backup, "layer_stored", self._layer_stored)
        reservations = backup.reservations
        _wrap(reservations, "reserve", self._reserve)
        _wrap(reservations, "claim", self._claim)
        _wrap(reservations, "settle", self._settle)
        _wrap(reservations, "land", self._land)
        _wrap(reservations, "clear", self._clear)
        _wrap(stack.controller, "write_storage", self._write_storage)

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        """One model forward (with an MTP draft: the target's, then the draft's): its
        reported layers and appended acks are checked at its end."""
        self._forward_tickets = list(self.backup.pipeline.held_ack_ids)
        self._forward_layers = 0
        acks_before = len(self.ack_queue)
        yield
        tickets, self._forward_tickets = self._forward_tickets, []
        acks = len(self.ack_queue) - acks_before
        if not tickets:
            return
        c = self.counters
        c.per_layer_forwards += 1
        c.per_layer_acks += acks
        if self._forward_layers != self.layer_num or acks != 1:
            self.violation(
                f"per-layer backups {tickets}: the forward reported {self._forward_layers} of "
                f"{self.layer_num} layers and appended {acks} acks (one, after the last layer)"
            )

    def check_between_batches(self, writes_in_flight: bool) -> None:
        """After ``check_hicache_events``: pending nodes not published before their ack,
        published at it; no reservation left unsettled; none in flight unless allowed."""
        for ticket, node_id in self._claimed.items():
            node = self._node(node_id)
            if node is not None and (node.write_through_pending_id is None or _lock_ref(node) <= 0):
                self.violation(
                    f"node {node_id} is host-visible (pending {node.write_through_pending_id}, lock "
                    f"{_lock_ref(node)}) before the ack of its per-layer backup (ticket {ticket})"
                )
        for node_id in self._committed:
            node = self._node(node_id)
            if node is not None and node.write_through_pending_id is not None:
                self.violation(f"node {node_id} still pending after its per-layer backup's ack")
        self._committed = []
        reservations = self.backup.reservations
        if reservations.rids():
            self.violation(f"reservations of requests {reservations.rids()} neither claimed nor settled")
        if not writes_in_flight and reservations.tickets_in_flight():
            self.violation(f"per-layer backups {reservations.tickets_in_flight()} still in flight")

    def _node(self, node_id: int) -> Any:
        """The tree's node ``node_id``; None once it left the tree (evicted, e.g. by a flush)."""
        try:
            return self.cache.tree_core.node_by_id(node_id)
        except KeyError:
            return None

    # ------------------------------------------------------------------ wrappers
    def _layer_stored(self, original: Callable, layer_id: int, num_locs: int) -> None:
        acks_before = len(self.ack_queue)
        original(layer_id, num_locs)
        if not self._forward_tickets:
            return
        self._forward_layers += 1
        self.counters.per_layer_layers += 1
        last_layer = layer_id == self.layer_num - 1 and not self.backup.pipeline.draft_layer_num
        if len(self.ack_queue) != acks_before and not last_layer:
            self.violation(
                f"per-layer backups {self._forward_tickets} acked at layer {layer_id} of "
                f"{self.layer_num}, before the last layer (the draft's, with an MTP draft) "
                "reached the host"
            )

    def _reserve(self, original: Callable, rid: str, write: Any, *args, **kwargs) -> Any:
        reservation = original(rid, write, *args, **kwargs)
        if reservation.ticket is not None:
            with self.untimed():
                slots = set(write.host_indices.tolist())
                self._unacked_slots[reservation.ticket] = slots
                self._acked_slots -= slots  # reused slots: filled anew
        return reservation

    def _write_storage(self, original: Callable, host_indices: Any, *args, **kwargs) -> Any:
        slots = set(host_indices.tolist())
        for ticket, unacked in self._unacked_slots.items():
            early = slots & unacked
            if early:
                self.violation(
                    f"L3 write of {len(early)} host slots (first {min(early)}) before the ack of "
                    f"their per-layer backup (ticket {ticket})"
                )
        if slots & self._acked_slots:
            self.counters.per_layer_l3_writes += 1
        return original(host_indices, *args, **kwargs)

    def _clear(self, original: Callable) -> None:
        """A flush: upstream cleared the host pools, every slot is free again."""
        original()
        self._unacked_slots.clear()
        self._acked_slots.clear()

    def _claim(self, original: Callable, node: int, pages: Any) -> Any:
        from sglang_cp_hicache.core.forward_reservations import Next

        transition = original(node, pages)
        if transition is not None and transition.reservation.ticket is not None:
            if transition.next is Next.AWAIT_ACK:
                self._claimed[transition.reservation.ticket] = node
            elif transition.next is Next.COMMIT:  # its ack landed before the insert
                self.counters.pending_committed += 1
        return transition

    def _settle(self, original: Callable, rid: str) -> Any:
        from sglang_cp_hicache.core.forward_reservations import Next

        transition = original(rid)
        if transition is not None and transition.next is Next.ROLL_BACK:
            self.counters.pending_rolled_back += 1
        return transition

    def _land(self, original: Callable, ticket: int) -> Any:
        from sglang_cp_hicache.core.forward_reservations import Next

        transition = original(ticket)
        slots = self._unacked_slots.pop(ticket, set())
        node = self._claimed.pop(ticket, None)
        if transition.next is not Next.ROLL_BACK:  # acked; claimed now or by its insert
            with self.untimed():
                self._acked_slots |= slots
        if transition.next is Next.COMMIT:
            self.counters.pending_committed += 1
            self._committed.append(node)
        elif transition.next is Next.ROLL_BACK:
            self.counters.pending_rolled_back += 1
        return transition


def _lock_ref(node: Any) -> int:
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType

    return node.component_data[ComponentType.FULL].lock_ref


def _wrap(owner: Any, name: str, around: Callable) -> None:
    """Replace ``owner.name`` on the instance by ``around(original, *args, **kwargs)``."""
    original = getattr(owner, name)

    @functools.wraps(original)
    def wrapped(*args, **kwargs):
        return around(original, *args, **kwargs)

    setattr(owner, name, wrapped)
