"""ForwardReservations, the state machine alone (no SGLang): reserve / claim / settle / land /
unclaimed in every order the scheduler can produce them.

* per layer: insert before the ack (commit at the ack), ack before the insert (commit at the
  claim), no claim (rolled back at the ack, never before), ack then no claim (rolled back at
  the settle);
* all layers at the insert: the claim hands the write over for submission, an unclaimed one
  is rolled back at its settle;
* tickets are negative, never -1, never reused; the maps answer only for live states.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import List, Optional, Tuple

import numpy as np
import pytest

from sglang_cp_hicache.core.forward_reservations import (
    FIRST_TICKET,
    ForwardReservations,
    Next,
    ReservationError,
    ReservationState,
)


@dataclass(frozen=True)
class Write:
    """Stands for the line's reserved host write (opaque to the machine)."""

    tokens: int


def make_machine() -> ForwardReservations[Write, str]:
    return ForwardReservations()


def pages(*ids: int) -> np.ndarray:
    return np.array(ids, dtype=np.int64)


# ------------------------------------------------------------------ per layer
def test_insert_before_ack_commits_the_claiming_node_at_the_ack():
    machine = make_machine()
    reservation = machine.reserve("a", Write(128), pages(4, 5), per_layer=True)
    claim = machine.claim("leaf-a", pages(4, 5))
    assert claim.reservation is reservation and claim.next is Next.AWAIT_ACK
    assert reservation.state is ReservationState.CLAIMED and reservation.node == "leaf-a"
    assert machine.in_flight(reservation.ticket) and machine.unclaimed() == []
    assert machine.settle("a") is None  # the insert claimed it: nothing left to settle
    landing = machine.land(reservation.ticket)
    assert landing.next is Next.COMMIT and landing.reservation.node == "leaf-a"
    assert not machine.in_flight(reservation.ticket) and machine.tickets_in_flight() == []


def test_ack_before_insert_commits_at_the_claim():
    machine = make_machine()
    reservation = machine.reserve("a", Write(128), pages(4, 5), per_layer=True)
    landing = machine.land(reservation.ticket)
    assert landing.next is Next.AWAIT_CLAIM and reservation.state is ReservationState.LANDED
    assert machine.unclaimed() == [reservation]  # its pages are in no node yet
    assert not machine.in_flight(reservation.ticket)  # a later ack id is a node's, not it
    claim = machine.claim("leaf-a", pages(4, 5))
    assert claim.next is Next.COMMIT and claim.reservation.node == "leaf-a"
    assert machine.unclaimed() == [] and machine.rids() == []


def test_no_claim_rolls_back_at_the_ack_never_before():
    machine = make_machine()
    reservation = machine.reserve("a", Write(128), pages(4, 5), per_layer=True)
    assert machine.claim("leaf-b", pages(9)) is None  # another request's leaf
    settle = machine.settle("a")  # insert miss, abort or retraction
    assert settle.next is Next.AWAIT_ACK and reservation.state is ReservationState.SETTLED
    assert machine.unclaimed() == [reservation] and machine.rids() == []
    assert machine.claim("leaf-a", pages(4, 5)) is None  # settled: no later claim
    landing = machine.land(reservation.ticket)
    assert landing.next is Next.ROLL_BACK and machine.unclaimed() == []


def test_ack_then_no_claim_rolls_back_at_the_settle():
    machine = make_machine()
    reservation = machine.reserve("a", Write(128), pages(4, 5), per_layer=True)
    machine.land(reservation.ticket)
    settle = machine.settle("a")
    assert settle.next is Next.ROLL_BACK and machine.unclaimed() == []


# ---------------------------------------------------------------- all layers
def test_all_layer_reservation_is_handed_over_at_the_claim():
    machine = make_machine()
    reservation = machine.reserve("a", Write(64), pages(7), per_layer=False)
    assert reservation.ticket is None and machine.tickets_in_flight() == []
    claim = machine.claim("leaf-a", pages(7))
    assert claim.next is Next.SUBMIT and claim.reservation.node == "leaf-a"
    assert machine.unclaimed() == [] and machine.settle("a") is None


def test_unclaimed_all_layer_reservation_rolls_back_at_its_settle():
    machine = make_machine()
    reservation = machine.reserve("a", Write(64), pages(7), per_layer=False)
    assert machine.unclaimed() == [reservation]
    assert machine.settle("a").next is Next.ROLL_BACK and machine.unclaimed() == []


# ----------------------------------------------------------- every order
Event = str  # "ack", "insert" (claims or misses), "settle" (always after "insert")


def _orders() -> List[Tuple[Event, ...]]:
    """Every order of one ack, one insert and its settle (the cache settles right after
    the insert, but the ack can pop anywhere: before, between, after)."""
    return [o for o in itertools.permutations(("ack", "insert", "settle")) if o.index("insert") < o.index("settle")]


@pytest.mark.parametrize("claimed", [True, False], ids=["claimed", "missed"])
@pytest.mark.parametrize("order", _orders(), ids="-".join)
def test_per_layer_decides_once_and_never_before_the_ack(order, claimed):
    machine = make_machine()
    reservation = machine.reserve("a", Write(128), pages(4, 5), per_layer=True)
    decisions: List[Next] = []
    acked = False
    for event in order:
        if event == "ack":
            transition, acked = machine.land(reservation.ticket), True
        elif event == "insert":
            transition = machine.claim("leaf-a", pages(4, 5) if claimed else pages(4, 6))
        else:
            transition = machine.settle("a")
        if transition is not None and transition.next in (Next.COMMIT, Next.ROLL_BACK):
            assert acked, f"{transition.next.value} at {event} before the ack ({order})"
            decisions.append(transition.next)
    assert decisions == [Next.COMMIT if claimed else Next.ROLL_BACK]
    assert machine.unclaimed() == [] and machine.tickets_in_flight() == [] and machine.rids() == []


@pytest.mark.parametrize("claimed", [True, False], ids=["claimed", "missed"])
def test_all_layer_decides_at_the_insert_or_its_settle(claimed):
    machine = make_machine()
    machine.reserve("a", Write(64), pages(7), per_layer=False)
    claim = machine.claim("leaf-a", pages(7) if claimed else pages(7, 8))
    settle = machine.settle("a")
    if claimed:
        assert claim.next is Next.SUBMIT and settle is None
    else:
        assert claim is None and settle.next is Next.ROLL_BACK


# ------------------------------------------------------------------- tickets
def test_tickets_are_negative_distinct_and_never_reused_after_a_flush():
    machine = make_machine()
    first = [machine.reserve(rid, Write(64), pages(10 + i), per_layer=True).ticket for i, rid in enumerate("abc")]
    assert first == [FIRST_TICKET, FIRST_TICKET - 1, FIRST_TICKET - 2] and all(t < -1 for t in first)
    assert machine.tickets_in_flight() == first
    machine.clear()
    assert machine.tickets_in_flight() == [] and machine.unclaimed() == [] and machine.rids() == []
    again = machine.reserve("a", Write(64), pages(10), per_layer=True).ticket
    assert again == FIRST_TICKET - 3  # a stale ack of a flushed ticket can never land here


def test_two_machines_fed_the_same_calls_draw_the_same_tickets():
    """Every rank reserves the same requests in the same order: the same ack ids."""

    def run() -> List[Optional[int]]:
        machine = make_machine()
        out = [machine.reserve("a", Write(1), pages(3), per_layer=True).ticket]
        machine.settle("a")
        out.append(machine.reserve("b", Write(1), pages(5), per_layer=False).ticket)
        out.append(machine.reserve("c", Write(1), pages(6), per_layer=True).ticket)
        return out

    assert run() == run() == [FIRST_TICKET, None, FIRST_TICKET - 1]


# ------------------------------------------------------------------- lookups
def test_a_claim_must_cover_exactly_the_reserved_pages():
    machine = make_machine()
    reservation = machine.reserve("a", Write(192), pages(4, 5, 6), per_layer=True)
    assert machine.claim("shorter", pages(4, 5)) is None  # starts there, is not that leaf
    assert machine.claim("longer", pages(4, 5, 6, 7)) is None
    assert machine.claim("empty", pages()) is None
    assert machine.get("a") is reservation and reservation.state is ReservationState.IN_FLIGHT
    assert machine.claim("leaf", pages(4, 5, 6)).next is Next.AWAIT_ACK
    assert machine.get("a") is None


def test_unclaimed_lists_every_reservation_no_node_holds():
    machine = make_machine()
    reserved = machine.reserve("r", Write(1), pages(1), per_layer=False)
    in_flight = machine.reserve("i", Write(1), pages(2), per_layer=True)
    claimed = machine.reserve("c", Write(1), pages(3), per_layer=True)
    landed = machine.reserve("l", Write(1), pages(4), per_layer=True)
    settled = machine.reserve("s", Write(1), pages(5), per_layer=True)
    machine.claim("leaf-c", pages(3))
    machine.land(landed.ticket)
    machine.settle("s")
    states = {r.rid: r.state for r in (reserved, in_flight, claimed, landed, settled)}
    assert states == {
        "r": ReservationState.RESERVED,
        "i": ReservationState.IN_FLIGHT,
        "c": ReservationState.CLAIMED,
        "l": ReservationState.LANDED,
        "s": ReservationState.SETTLED,
    }
    assert {r.rid for r in machine.unclaimed()} == {"r", "i", "l", "s"}
    assert machine.rids() == ["r", "i", "l"]
    assert sorted(machine.tickets_in_flight()) == sorted([in_flight.ticket, claimed.ticket, settled.ticket])


# -------------------------------------------------------------------- misuse
def test_misuse_fails_fast_naming_the_request():
    machine = make_machine()
    machine.reserve("a", Write(1), pages(4), per_layer=True)
    with pytest.raises(ReservationError, match="request a already holds"):
        machine.reserve("a", Write(1), pages(8), per_layer=True)
    with pytest.raises(ReservationError, match="request b: logical page 4 is already reserved by request a"):
        machine.reserve("b", Write(1), pages(4, 5), per_layer=False)
    with pytest.raises(ValueError, match="request c: .*at least one page"):
        machine.reserve("c", Write(1), pages(), per_layer=True)
    with pytest.raises(ReservationError, match="ticket -99 is no per-layer reservation in flight"):
        machine.land(-99)
    ticket = machine.get("a").ticket
    machine.land(ticket)
    with pytest.raises(ReservationError, match=f"ticket {ticket}"):
        machine.land(ticket)  # one ack per reservation
