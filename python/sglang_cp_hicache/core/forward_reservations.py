"""The forward-reservation state machine: host pages reserved before a prefill forward for
the leaf a request's insert will create, until that leaf commits them or they are rolled back.

Pure decisions over replicated state (no SGLang, no tree type, no transfer): the cache asks
:class:`ForwardReservations` what to do and does it (submit, commit, roll back, lock). Every
rank reserves the same requests in the same order, so every rank holds the same machine.

States (``ReservationState``) and the calls that move them::

    reserve(per_layer=False) -> RESERVED    reserve(per_layer=True) -> IN_FLIGHT (ticket drawn)

    RESERVED  --claim-->  (gone)  SUBMIT:     name the node, submit all layers; its ack commits
              --settle--> (gone)  ROLL_BACK:  nothing was submitted, roll back now
    IN_FLIGHT --claim-->  CLAIMED AWAIT_ACK:  the ticket's ack will commit the claiming node
              --settle--> SETTLED AWAIT_ACK:  the transfer may still write the pages
              --land-->   LANDED  AWAIT_CLAIM: the ack popped before the insert (overlap)
    CLAIMED   --land-->   (gone)  COMMIT:     commit the node now
    SETTLED   --land-->   (gone)  ROLL_BACK:  rolled back at its ack, never before
    LANDED    --claim-->  (gone)  COMMIT:     commit the node at once (nothing in flight)
              --settle--> (gone)  ROLL_BACK

Invariants (checked where the maps change):

* a reservation is found by its rid and by its first logical device page exactly while it
  is unclaimed and unsettled (RESERVED, IN_FLIGHT, LANDED): one per rid, one per first page;
* it is found by its ticket exactly while its ack has not popped (IN_FLIGHT, CLAIMED,
  SETTLED); only per-layer reservations have tickets;
* a per-layer reservation is never rolled back before its ack and never committed before
  both its ack and its claim.

Tickets are ack ids: negative (-2, -3, ...; -1 is "no node"), drawn from this machine's own
counter, so they never collide with node ids (>= 0). On 0.5.12 they ride in upstream's
``ongoing_write_through`` (value None) from the reservation until the claim or the ack,
because that map is what upstream reads to run ``writing_check``'s MIN all-reduce (an empty
map skips it) and what the scheduler's idle check counts before a flush: a transfer in
flight must keep both waiting, and keeping it there needs no override of either.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Dict, Generic, List, Optional, TypeVar

import numpy as np

WriteT = TypeVar("WriteT")  # the line's reserved host write (opaque here)
NodeT = TypeVar("NodeT")  # the line's radix node handle (opaque here)

FIRST_TICKET = -2  # -1 stands for "no node" in SGLang's write ops


class ReservationState(enum.Enum):
    RESERVED = "reserved"  # all layers at the insert: nothing submitted yet, unclaimed
    IN_FLIGHT = "in_flight"  # per layer: submitted, unclaimed, ack not popped
    CLAIMED = "claimed"  # per layer: claimed by a node, ack not popped
    LANDED = "landed"  # per layer: ack popped, unclaimed
    SETTLED = "settled"  # per layer: left unclaimed, ack not popped
    COMMITTED = "committed"  # decided: the pages are the claiming node's (now or at its ack)
    ROLLED_BACK = "rolled_back"  # decided: the pages are rolled back


class Next(enum.Enum):
    """What the caller must do after a transition."""

    SUBMIT = "submit"  # name the claiming node on the write, submit it all layers at once
    AWAIT_ACK = "await_ack"  # nothing now: the reservation's ack decides
    AWAIT_CLAIM = "await_claim"  # nothing now: the claim (or the settle) decides
    COMMIT = "commit"  # commit the pages to ``reservation.node`` now
    ROLL_BACK = "roll_back"  # free exactly the reserved pages now


@dataclass
class ForwardReservation(Generic[WriteT, NodeT]):
    """Host pages reserved for the leaf ``rid``'s insert will create, over the logical
    device ``pages`` that leaf must hold exactly (its first page is the lookup key)."""

    rid: str
    write: WriteT
    pages: np.ndarray
    ticket: Optional[int] = None  # per layer: the ack id of its transfer
    node: Optional[NodeT] = None  # the claiming node
    state: ReservationState = ReservationState.RESERVED

    @property
    def first_page(self) -> int:
        return int(self.pages[0])


@dataclass(frozen=True)
class Transition(Generic[WriteT, NodeT]):
    reservation: ForwardReservation[WriteT, NodeT]
    next: Next


class ReservationError(RuntimeError):
    """A call the state machine forbids: a caller-logic bug (ranks would diverge)."""


class ForwardReservations(Generic[WriteT, NodeT]):
    """Reservations made before prefill forwards, by rid, by first page and by ticket.

    The only owner of the three maps and the ticket counter; callers read through
    :meth:`get`, :meth:`unclaimed`, :meth:`tickets_in_flight` and :meth:`in_flight`.
    """

    def __init__(self) -> None:
        self._by_rid: Dict[str, ForwardReservation[WriteT, NodeT]] = {}
        self._rid_by_first_page: Dict[int, str] = {}
        self._by_ticket: Dict[int, ForwardReservation[WriteT, NodeT]] = {}
        self._next_ticket = FIRST_TICKET

    # ------------------------------------------------------------------ reads
    def get(self, rid: str) -> Optional[ForwardReservation[WriteT, NodeT]]:
        """``rid``'s reservation while it is neither claimed nor settled."""
        return self._by_rid.get(rid)

    def rids(self) -> List[str]:
        """Rids with a reservation neither claimed nor settled, in reservation order."""
        return list(self._by_rid)

    def in_flight(self, ack_id: int) -> bool:
        """Whether ``ack_id`` is the ticket of a per-layer reservation whose ack has not popped."""
        return ack_id in self._by_ticket

    def tickets_in_flight(self) -> List[int]:
        return list(self._by_ticket)

    def unclaimed(self) -> List[ForwardReservation[WriteT, NodeT]]:
        """Reservations no node holds: not claimed yet, or settled with their ack in flight
        (their pages are reserved but in no tree node)."""
        settled = [r for r in self._by_ticket.values() if r.state is ReservationState.SETTLED]
        return list(self._by_rid.values()) + settled

    # ---------------------------------------------------------------- changes
    def reserve(
        self, rid: str, write: WriteT, pages: np.ndarray, per_layer: bool
    ) -> ForwardReservation[WriteT, NodeT]:
        """Record ``write`` for the leaf over ``pages`` (logical device pages) that ``rid``'s
        insert will create; ``per_layer``: it is submitted now, its ack carries the returned
        reservation's ``ticket``. The caller settles ``rid``'s earlier reservation first."""
        if not len(pages):
            raise ValueError(f"request {rid}: a forward reservation needs at least one page")
        first_page = int(pages[0])
        if rid in self._by_rid:
            raise ReservationError(f"request {rid} already holds an unsettled forward reservation")
        if first_page in self._rid_by_first_page:
            raise ReservationError(
                f"request {rid}: logical page {first_page} is already reserved by request "
                f"{self._rid_by_first_page[first_page]}"
            )
        reservation: ForwardReservation[WriteT, NodeT] = ForwardReservation(rid, write, np.asarray(pages))
        if per_layer:
            reservation.ticket, self._next_ticket = self._next_ticket, self._next_ticket - 1
            reservation.state = ReservationState.IN_FLIGHT
            self._by_ticket[reservation.ticket] = reservation
        self._by_rid[rid] = reservation
        self._rid_by_first_page[first_page] = rid
        return reservation

    def claim(self, node: NodeT, pages: np.ndarray) -> Optional[Transition[WriteT, NodeT]]:
        """The insert created ``node`` over ``pages``: the reservation for exactly those
        pages, if any, now belongs to it. None when no reservation starts there or the one
        that does covers other pages (the node starts on them but is not that leaf)."""
        if not self._rid_by_first_page or not len(pages):
            return None
        rid = self._rid_by_first_page.get(int(pages[0]))
        if rid is None:
            return None
        reservation = self._by_rid[rid]
        if not np.array_equal(reservation.pages, pages):
            return None
        self._unlist(reservation)
        reservation.node = node
        state = reservation.state
        if state is ReservationState.RESERVED:
            reservation.state = ReservationState.COMMITTED  # at the ack of its submission
            return Transition(reservation, Next.SUBMIT)
        if state is ReservationState.IN_FLIGHT:
            reservation.state = ReservationState.CLAIMED
            return Transition(reservation, Next.AWAIT_ACK)
        self._expect(reservation, ReservationState.LANDED, "claimed")
        reservation.state = ReservationState.COMMITTED
        return Transition(reservation, Next.COMMIT)

    def settle(self, rid: str) -> Optional[Transition[WriteT, NodeT]]:
        """``rid``'s insert is done (or will not come: abort, retraction): its reservation,
        if no node claimed it, is rolled back now, or at its ack while a transfer may still
        be writing its pages. None when ``rid`` holds no unclaimed reservation."""
        reservation = self._by_rid.get(rid)
        if reservation is None:
            return None
        self._unlist(reservation)
        if reservation.state is ReservationState.IN_FLIGHT:
            reservation.state = ReservationState.SETTLED
            return Transition(reservation, Next.AWAIT_ACK)
        reservation.state = ReservationState.ROLLED_BACK
        return Transition(reservation, Next.ROLL_BACK)

    def land(self, ticket: int) -> Transition[WriteT, NodeT]:
        """The ack of ``ticket`` popped on every rank: commit its claiming node, roll back
        one left unclaimed, or wait for the claim."""
        reservation = self._by_ticket.pop(ticket, None)
        if reservation is None:
            raise ReservationError(f"ticket {ticket} is no per-layer reservation in flight")
        if reservation.state is ReservationState.CLAIMED:
            reservation.state = ReservationState.COMMITTED
            return Transition(reservation, Next.COMMIT)
        if reservation.state is ReservationState.SETTLED:
            reservation.state = ReservationState.ROLLED_BACK
            return Transition(reservation, Next.ROLL_BACK)
        self._expect(reservation, ReservationState.IN_FLIGHT, "landed")
        reservation.state = ReservationState.LANDED
        return Transition(reservation, Next.AWAIT_CLAIM)

    def clear(self) -> None:
        """Forget everything (a flush: the controller frees every host page itself). The
        ticket counter keeps counting: a ticket is never reused."""
        self._by_rid.clear()
        self._rid_by_first_page.clear()
        self._by_ticket.clear()

    # --------------------------------------------------------------- internal
    def _unlist(self, reservation: ForwardReservation[WriteT, NodeT]) -> None:
        """Drop an unclaimed, unsettled reservation from the rid and first-page maps."""
        del self._by_rid[reservation.rid]
        del self._rid_by_first_page[reservation.first_page]

    @staticmethod
    def _expect(reservation: ForwardReservation, state: ReservationState, verb: str) -> None:
        if reservation.state is not state:
            raise ReservationError(
                f"request {reservation.rid}'s reservation {verb} in state {reservation.state.value}"
            )
