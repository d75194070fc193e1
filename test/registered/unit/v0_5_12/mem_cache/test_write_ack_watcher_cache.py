"""The 0.5.12 line's cache with the async write-ack watcher (CP on and off): on CPU no thread
starts; with held events an ack waits, pops right after release through ``writing_check``
(each write one ack, zero-owned ones too), and ``shutdown``/``reset`` leave no watcher
thread behind. The watcher alone: ``unit/core/test_write_ack_watcher.py``.
"""

from __future__ import annotations

import threading

import pytest
import torch

from sglang_cp_hicache.core.write_ack_watcher import WriteAckWatcher
from sglang_cp_hicache.testing import device_module
from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


def _threads(watcher: WriteAckWatcher) -> list:
    return [t for t in threading.enumerate() if t.name == watcher.thread_name]


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
