"""``core.l3_event_log.L3EventLog``: a storage write's events held until its ack, released
once; the blocks published per medium, retracted once; the tracked set bounded."""

import pytest

from sglang_cp_hicache.core.l3_event_log import HeldWrite, L3EventLog


def test_a_held_write_is_released_once():
    log = L3EventLog()
    log.hold(7, HeldWrite("DISK", ("e1", "e2")))
    assert log.held_operations == 1
    assert log.release(7) == HeldWrite("DISK", ("e1", "e2"))
    assert log.release(7) is None and log.held_operations == 0


def test_an_operation_holds_its_events_once():
    log = L3EventLog()
    log.hold(1, HeldWrite("DISK", ()))
    with pytest.raises(RuntimeError, match="operation 1"):
        log.hold(1, HeldWrite("DISK", ()))


def test_writes_no_longer_in_flight_are_forgotten():
    log = L3EventLog()
    for op in (1, 2, 3):
        log.hold(op, HeldWrite("DISK", ()))
    assert log.forget_except({2}) == 2
    assert log.release(1) is None and log.release(3) is None
    assert log.release(2) is not None


def test_retract_names_every_tracked_block_by_medium_once():
    log = L3EventLog()
    log.track_stored("DISK", [1, 2])
    log.track_stored("EXTERNAL", [9])
    log.track_stored("DISK", [1, 3])  # a re-store moves 1 to the newest end
    log.hold(5, HeldWrite("DISK", ()))
    assert log.tracked("DISK") == [2, 1, 3]
    assert log.retract() == {"DISK": [2, 1, 3], "EXTERNAL": [9]}
    assert log.retract() == {} and log.held_operations == 0


def test_the_tracked_set_is_bounded_oldest_first():
    log = L3EventLog(max_tracked=3)
    log.track_stored("DISK", [1, 2, 3, 4, 5])
    assert log.tracked("DISK") == [3, 4, 5] and log.forgotten == 2
    with pytest.raises(ValueError):
        L3EventLog(max_tracked=0)
