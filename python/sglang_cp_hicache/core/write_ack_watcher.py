"""Counts finished HiCache write acks off the scheduler thread.

Upstream ``writing_check`` queries the finish event of every queued write ack on each
scheduler step until it meets an unfinished one. :class:`WriteAckWatcher` takes the acks
over once, in queue order, and a background thread polls the oldest unfinished one, so a
step usually reads a counter instead of querying events.

It decides nothing: ``writing_check`` still MIN-all-reduces this rank's count across the
attention groups and pops that many acks from the head of the queue, so acks pop in order
and only through that one collective. Events complete at hand-over are counted on the
spot (on CPU every event is, so no thread ever starts); the scheduler also probes the
oldest pending event on each call, so a finished ack is never missed because the thread
has not polled yet. The thread starts when an unfinished ack is handed over, exits after
``linger_s`` without one, and :meth:`stop` joins it.
"""

from __future__ import annotations

import collections
import itertools
import threading
from typing import Any, Deque, Optional, Sequence

THREAD_NAME_PREFIX = "cp-hicache-write-ack"
_serial = itertools.count()


class WriteAckWatcher:
    """Leading finished acks of one controller's ``ack_write_queue``.

    Invariant: ``finished + len(pending) == tracked <= len(ack_write_queue)``, where
    ``tracked`` counts the queue's leading acks already handed over; ``finished`` of them
    are done, ``pending`` holds the finish events of the rest, oldest first. ``sync`` and
    ``consume`` run on the scheduler thread only; while a thread runs, the lock guards
    ``finished``/``pending`` (without one, the scheduler thread alone touches them).
    """

    def __init__(self, poll_s: float = 1e-3, linger_s: float = 1.0) -> None:
        self._poll_s = poll_s
        self._linger_s = linger_s
        self.thread_name = f"{THREAD_NAME_PREFIX}-{next(_serial)}"
        self._cond = threading.Condition()
        self._pending: Deque[Any] = collections.deque()
        self._finished = 0
        self._tracked = 0
        self._stopping = False
        # A thread is polling or lingering: written under the lock, read without it by the
        # scheduler thread, which alone sets it (True, when starting one).
        self._running = False
        self._thread: Optional[threading.Thread] = None  # the latest one started

    def sync(self, ack_queue: Sequence[Any]) -> int:
        """Take over acks appended since the last call; return the leading finished ones."""
        start, self._tracked = self._tracked, len(ack_queue)
        if not self._running and not self._pending:
            # No thread (none started, or the last one cleared _running as its final step
            # under the lock; only this thread starts one): the counters are this thread's
            # alone, so the usual call, every new ack finished at hand-over, takes no lock.
            start = self._count_finished_from(ack_queue, start)
            if start == self._tracked:
                return self._finished
        with self._cond:
            self._pending.extend(ack_queue[i].finish_event for i in range(start, self._tracked))
            self._count_finished_locked()
            if self._pending:
                self._ensure_thread_locked()
            return self._finished

    def consume(self, count: int) -> None:
        """The first ``count`` acks (all finished) left the queue."""
        self._tracked -= count
        if not self._running:  # see sync: no thread, no lock
            self._finished -= count
            return
        with self._cond:
            self._finished -= count

    def stop(self) -> None:
        """Join the thread and forget every ack (the queue was cleared or is abandoned)."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        with self._cond:
            self._stopping = False
            self._thread = None
            self._pending.clear()
            self._finished = 0
        self._tracked = 0

    # ------------------------------------------------------------------ internals
    def _count_finished_from(self, ack_queue: Sequence[Any], start: int) -> int:
        """Count the leading finished acks of ``ack_queue[start:]`` (nothing pending, no
        thread); return the index of the first unfinished one (the queue's length if none)."""
        for index in range(start, self._tracked):
            if not ack_queue[index].finish_event.query():
                return index
            self._finished += 1
        return self._tracked

    def _count_finished_locked(self) -> None:
        # Write-stream events finish in order: stop at the first unfinished one.
        while self._pending and self._pending[0].query():
            self._pending.popleft()
            self._finished += 1

    def _ensure_thread_locked(self) -> None:
        if self._running:
            self._cond.notify()
            return
        if self._thread is not None:
            # It left the lock for good when it cleared _running: this join is immediate
            # and keeps at most one watcher thread alive.
            self._thread.join()
        self._running = True
        self._thread = threading.Thread(target=self._run, name=self.thread_name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        with self._cond:
            while not self._stopping:
                self._count_finished_locked()
                if self._pending:
                    self._cond.wait(self._poll_s)
                elif not self._cond.wait_for(
                    lambda: self._pending or self._stopping, self._linger_s
                ):
                    break  # idle: the next unfinished ack starts a fresh thread
            self._running = False
