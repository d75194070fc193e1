"""Async write-ack watcher alone (fake events; both lines): finished-at-hand-over acks count at
once without a thread; an unfinished one starts the thread, which counts it when it
finishes; counting stops at the first unfinished ack; an idle thread exits; ``stop`` joins
it. Without a thread, finished acks are counted without taking the lock, and once the thread
has exited the calls are lock-free again, with the counts of the locked path. The 0.5.12
line's cache with the watcher: ``unit/v0_5_12/mem_cache/test_write_ack_watcher_cache.py``.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

from sglang_cp_hicache.core.write_ack_watcher import WriteAckWatcher


def _threads(watcher: WriteAckWatcher) -> list:
    return [t for t in threading.enumerate() if t.name == watcher.thread_name]


def _wait_until(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.002)
    return True


class FakeEvent:
    """A write-finish event that records which thread saw it finished."""

    def __init__(self, done: bool = False) -> None:
        self.done = done
        self.seen_done_by = None

    def query(self) -> bool:
        if self.done and self.seen_done_by is None:
            self.seen_done_by = threading.current_thread().name
        return self.done


def _ack(event: FakeEvent) -> SimpleNamespace:
    return SimpleNamespace(finish_event=event, node_ids=[0])


# ------------------------------------------------------------------ watcher alone
def test_finished_acks_count_at_hand_over_without_a_thread():
    watcher = WriteAckWatcher()
    queue = [_ack(FakeEvent(done=True)) for _ in range(3)]
    assert watcher.sync(queue) == 3
    assert not _threads(watcher)
    watcher.consume(2)
    del queue[:2]
    queue.append(_ack(FakeEvent(done=True)))
    assert watcher.sync(queue) == 2


def test_thread_counts_unfinished_acks_in_queue_order():
    watcher = WriteAckWatcher(poll_s=1e-3, linger_s=5.0)
    first, second = FakeEvent(), FakeEvent()
    queue = [_ack(first), _ack(second)]
    assert watcher.sync(queue) == 0 and _threads(watcher)
    second.done = True  # out of order: must not count before the first
    time.sleep(0.02)
    assert watcher.sync(queue) == 0
    first.done = True
    assert _wait_until(lambda: first.seen_done_by is not None)
    assert _wait_until(lambda: second.seen_done_by is not None)
    assert first.seen_done_by == watcher.thread_name  # counted off the calling thread
    assert watcher.sync(queue) == 2
    watcher.stop()
    assert not _threads(watcher)


def test_idle_thread_exits_and_restarts_on_demand():
    watcher = WriteAckWatcher(poll_s=1e-3, linger_s=0.05)
    event = FakeEvent()
    queue = [_ack(event)]
    watcher.sync(queue)
    event.done = True
    assert _wait_until(lambda: not _threads(watcher))
    assert watcher.sync(queue) == 1
    watcher.consume(1)
    queue.clear()
    queue.append(_ack(FakeEvent()))
    assert watcher.sync(queue) == 0 and _threads(watcher)
    watcher.stop()
    assert not _threads(watcher)
    assert watcher.sync([]) == 0  # forgotten: a cleared queue starts from scratch


# ---------------------------------------------------------- the lock-free path


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
