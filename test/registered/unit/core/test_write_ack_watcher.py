"""Async write-ack watcher: counts finished acks in order, never decides, never leaks.

* Watcher alone (fake events): finished-at-hand-over acks count at once without a thread;
  an unfinished one starts the thread, which counts it when it finishes; counting stops at
  the first unfinished ack; an idle thread exits; ``stop`` joins it.
* Cache (CP on and off): on CPU no thread starts; with held events an ack waits, pops right
  after release through ``writing_check`` (each write one ack, zero-owned ones too), and
  ``shutdown``/``reset`` leave no watcher thread behind.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from sglang_cp_hicache.core.write_ack_watcher import WriteAckWatcher
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


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


# ------------------------------------------------------------------ cache
def _stack(gloo_world1, shared_kv: bool):
    return nsa_stack.unit_stack(gloo_world1, shared_kv, layer_num=1)


@pytest.mark.parametrize("shared_kv", [False, True], ids=["cp_off", "cp_on"])
def test_cpu_events_complete_at_once_without_a_thread(gloo_world1, shared_kv):
    stack = _stack(gloo_world1, shared_kv)
    nodes = [nsa_stack.insert_at_root(stack, list(range(i * 1000, i * 1000 + 2 * PS))) for i in range(1, 4)]
    stack.cache.check_hicache_events()
    assert not stack.cache.ongoing_write_through
    assert all(n.lock_ref == 0 for n in nodes)
    assert not _threads(stack.cache._write_acks)
    stack.cache.shutdown()
    stack.close()


@pytest.mark.parametrize("shared_kv", [False, True], ids=["cp_off", "cp_on"])
@pytest.mark.parametrize("teardown", ["shutdown", "reset"])
def test_in_flight_acks_pop_after_release_and_no_thread_survives(gloo_world1, shared_kv, teardown):
    stack = _stack(gloo_world1, shared_kv)
    cache = stack.cache
    with device_module().hold_events() as hold:
        nodes = [nsa_stack.insert_at_root(stack, list(range(i * 1000, i * 1000 + 2 * PS))) for i in range(1, 3)]
        if shared_kv:  # a node this rank owns nothing of still acks once
            lane1_only = stack.allocator.alloc_pages_with_owners(torch.ones(2, dtype=torch.int64))
            nodes.append(nsa_stack.insert_at_root(stack, list(range(50000, 50000 + 2 * PS)), lane1_only))
            assert cache.pending_backups[nodes[-1].id].write.operation is None
        cache.check_hicache_events()
        assert set(cache.ongoing_write_through) == {n.id for n in nodes}
        assert len(_threads(cache._write_acks)) == 1
        hold.release()
    cache.check_hicache_events()  # no wait for the thread's next poll
    assert not cache.ongoing_write_through and not cache.cache_controller.ack_write_queue
    assert all(n.lock_ref == 0 and n.backuped for n in nodes)
    getattr(cache, teardown)()
    assert not _threads(cache._write_acks)
    stack.close()
