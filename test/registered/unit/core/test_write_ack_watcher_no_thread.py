"""The write-ack watcher without a thread (both lines): acks finished at hand-over are
counted without taking the lock (the usual call on the ack path), counting stops at the
first unfinished ack, which (with every later one) goes to the thread; once the thread has
exited the calls are lock-free again; the counts stay those of the locked path throughout.
The watcher with its thread: ``test_write_ack_watcher.py``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from sglang_cp_hicache.core.write_ack_watcher import WriteAckWatcher


class CountingCondition:
    """``threading.Condition`` that counts how often it is entered."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.entered = 0

    def __enter__(self):
        self.entered += 1
        return self._cond.__enter__()

    def __exit__(self, *exc):
        return self._cond.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self._cond, name)


class Event:
    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done


def _acks(*done: bool) -> list:
    return [SimpleNamespace(finish_event=Event(d), node_ids=[i]) for i, d in enumerate(done)]


def _threads(watcher: WriteAckWatcher) -> list:
    return [t for t in threading.enumerate() if t.name == watcher.thread_name]


def _wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


def _watcher(linger_s: float = 5.0):
    watcher = WriteAckWatcher(poll_s=1e-3, linger_s=linger_s)
    watcher._cond = cond = CountingCondition()
    return watcher, cond


def test_finished_acks_count_without_the_lock():
    watcher, cond = _watcher()
    queue = _acks(True, True)
    assert watcher.sync(queue) == 2
    watcher.consume(1)
    del queue[:1]
    queue += _acks(True)
    assert watcher.sync(queue) == 2  # one left over, one new
    watcher.consume(2)
    del queue[:2]
    assert watcher.sync(queue) == 0
    assert cond.entered == 0
    watcher.stop()


def test_an_unfinished_ack_stops_the_count_and_goes_to_the_thread():
    watcher, cond = _watcher()
    queue = _acks(True, False, True)  # the third is done but behind an unfinished one
    assert watcher.sync(queue) == 1
    assert cond.entered > 0 and _threads(watcher)
    queue[1].finish_event.done = True
    assert _wait_until(lambda: watcher.sync(queue) == 3)
    watcher.consume(3)
    del queue[:3]
    assert watcher.sync(queue) == 0
    watcher.stop()


def test_lock_free_again_once_the_thread_has_exited():
    watcher, cond = _watcher(linger_s=0.02)
    queue = _acks(False)
    assert watcher.sync(queue) == 0
    queue[0].finish_event.done = True
    assert _wait_until(lambda: not _threads(watcher))  # counted it, lingered, exited
    entered = cond.entered
    assert watcher.sync(queue) == 1
    watcher.consume(1)
    del queue[:1]
    queue += _acks(True, True)
    assert watcher.sync(queue) == 2
    assert cond.entered == entered
    watcher.stop()
