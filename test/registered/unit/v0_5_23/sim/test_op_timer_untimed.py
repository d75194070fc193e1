"""``OpTimer.untimed``: the simulator's own bookkeeping inside a timed cache call (its
checkers' records) is no operation's time: the enclosing operation's sample leaves it out,
while the call's own work stays in."""

from __future__ import annotations

import time

from sglang_cp_hicache.sim.collectives import CollectiveCounter
from sglang_cp_hicache.sim.engine import OpTimer

BURN_S = 0.05


def _burn(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_bookkeeping_inside_an_operation_is_taken_out_of_it() -> None:
    timer = OpTimer(CollectiveCounter())
    with timer.op("insert"):
        _burn(BURN_S)  # the call's own work
        with timer.untimed():
            _burn(BURN_S)  # a checker's records
    timer.end_step()
    (sample_us,) = timer.samples["insert"]
    assert BURN_S * 1e6 * 0.9 <= sample_us < BURN_S * 1e6 * 1.5


def test_bookkeeping_outside_any_operation_changes_nothing() -> None:
    timer = OpTimer(CollectiveCounter())
    with timer.untimed():
        _burn(0.001)
    timer.end_step()
    assert all(samples == [] for samples in timer.samples.values())
