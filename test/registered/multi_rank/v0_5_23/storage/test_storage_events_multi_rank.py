"""L3 KV events (``DISK`` for the file backend, ``EXTERNAL`` for the Mooncake store) on the
real 0.5.23 sharded stack, cp 2.

The recorder is on where the scheduler turns it on (shard rank 0, the publisher). A
request's storage write publishes one ``BlockStored(DISK)`` chain with the node's own
hashes, parent link and tokens (the blocks its ``CPU_PINNED`` event named), once, when both
ranks have acked it: rank 1's writes are slowed, and rank 0 drains with its own ack already
queued and publishes nothing until upstream's MIN lets the ack through. A write that fails
on the publisher's own pages is published up to the logical prefix the other rank's pages
cover; a clear and a detach of the tier (the admin API's calls) retract every block
published. Rank 1 publishes nothing. The same write on a real Mooncake store (a master on
loopback) publishes ``EXTERNAL``, and its detach retracts it. Flag off (an unsharded stack
with upstream's file backend): no L3 event.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
SEED = 20261207
FIRST = list(range(1, 5 * PAGE + 1))
SECOND = list(range(70_001, 70_001 + 4 * PAGE))
THIRD = list(range(90_001, 90_001 + 2 * PAGE))
SLOW_WRITE_S = 0.4
SET_METHODS = ("batch_set", "batch_set_v1", "batch_set_v2")


def describe(events: List[Any]) -> List[Dict[str, Any]]:
    """Events as plain values (picklable), one entry per event."""
    from sglang.srt.disaggregation.kv_events import BlockStored

    described = []
    for event in events:
        entry: Dict[str, Any] = {"type": type(event).__name__}
        if hasattr(event, "block_hashes"):
            entry.update(medium=str(getattr(event.medium, "value", event.medium)), hashes=list(event.block_hashes))
        if isinstance(event, BlockStored):
            entry.update(parent=event.parent_block_hash, tokens=list(event.token_ids))
        described.append(entry)
    return described


def _planted(backend: Any, wrap: Callable[[Callable], Callable]) -> Callable[[], None]:
    """Every storage write method of ``backend`` wrapped by ``wrap``; the undo."""
    originals = {name: getattr(backend, name) for name in SET_METHODS}
    for name, original in originals.items():
        setattr(backend, name, wrap(original))
    return lambda: [setattr(backend, name, fn) for name, fn in originals.items()] and None


def _slowed(original: Callable) -> Callable:
    def slowed(*args: Any, **kwargs: Any) -> Any:
        time.sleep(SLOW_WRITE_S)
        return original(*args, **kwargs)

    return slowed


def _failing(calls: List[int]) -> Callable[[Callable], Callable]:
    def wrap(original: Callable) -> Callable:
        def failed(keys_or_transfers: Any, *args: Any, **kwargs: Any) -> Any:
            calls.append(1)
            if original.__name__ == "batch_set":
                return False
            if original.__name__ == "batch_set_v2":
                return {t.name: [False] * len(t.keys or []) for t in keys_or_transfers}
            return [False] * len(keys_or_transfers)

        return failed

    return wrap


def store_watching_acks(stack: Any, tokens: List[int]) -> Dict[str, Any]:
    """Store ``tokens`` and drive the acks step by step (every rank in lockstep): its events
    on this rank, and how many drains saw this rank's own storage ack queued while no DISK
    event had been published (upstream's MIN held it back)."""
    import torch

    from sglang_cp_hicache.testing.v0_5_23 import storage

    locs, base = stack.alloc_extend(torch.empty((0,), dtype=torch.int64), len(tokens))
    storage.write_owned_rows(stack, locs, storage.logical_kv(stack, tokens, SEED))
    stack.insert(tokens, locs, base)
    stack.cache.flush_pending_backups()
    cache, controller = stack.cache, stack.controller
    events: List[Dict[str, Any]] = []
    held_back = 0
    for _ in range(storage.WAIT_STEPS):
        cache.writing_check()
        own_ack_queued = controller.ack_backup_queue.qsize() > 0
        cache.drain_storage_control_queues()
        events += describe(cache.take_events())
        published = any(e.get("medium") in ("DISK", "EXTERNAL") for e in events)
        held_back += int(own_ack_queued and not published)
        if storage._all_ranks(stack, not cache.ongoing_backup):
            return {"events": events, "held_back": held_back}
        time.sleep(storage.WAIT_STEP_S)
    raise TimeoutError(f"rank {stack.shard_rank}: L3 backups never acked")


def publisher_cut(stack: Any, tokens: List[int]) -> int:
    """The pages of ``tokens``'s node before the first one rank 0 owns on host: what a
    write failing on every page of rank 0 still covers logically."""
    node = next(v for v in stack.tree_snapshot() if list(v.token_ids) == tokens)
    first_pages = __import__("torch").tensor(node.logical_host_locs[::PAGE])
    owned = stack.kv_host_pool.placement.local_mask(first_pages, 0).tolist()
    return owned.index(True) if True in owned else len(owned)


def events_run(ctx: RankContext, folder: str) -> Dict[str, Any]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, sharded_stack

    report: Dict[str, Any] = {}
    with sharded_stack(ctx, StackConfig(cp_shared_kv=True, kv_events=True)) as stack:
        backend = storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        report["startup"] = describe(stack.cache.take_events())
        undo = _planted(backend, _slowed) if ctx.rank == 1 else (lambda: None)
        report["first"] = store_watching_acks(stack, FIRST)
        undo()
        calls: List[int] = []
        undo = _planted(backend, _failing(calls)) if ctx.rank == 0 else (lambda: None)
        report["second"] = store_watching_acks(stack, SECOND)
        undo()
        report["second_failed_writes"] = len(calls)
        report["second_cut"] = publisher_cut(stack, SECOND)
        assert stack.cache.clear_storage_backend()
        report["clear"] = describe(stack.cache.take_events())
        report["third"] = store_watching_acks(stack, THIRD)
        report["detach_ok"] = stack.cache.detach_storage_backend()[0]
        report["detach"] = describe(stack.cache.take_events())
    return report


def mooncake_run(ctx: RankContext, config: Dict[str, Any]) -> Dict[str, Any]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, sharded_stack

    # Mooncake's zero-copy path needs a page-first host layout.
    with sharded_stack(ctx, StackConfig(cp_shared_kv=True, kv_events=True, mem_layout="page_first")) as stack:
        storage.attach_storage(stack, "mooncake", extra=config)
        stack.cache.take_events()
        report = {"first": store_watching_acks(stack, FIRST)}
        report["detach_ok"] = stack.cache.detach_storage_backend()[0]
        report["detach"] = describe(stack.cache.take_events())
    return report


def flag_off_run(ctx: RankContext, folder: str) -> Dict[str, Any]:
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_unsharded_stack

    storage.apply_plugin_hooks()
    with build_unsharded_stack(ctx.attn_tp_group, StackConfig(kv_events=True)) as stack:
        storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
        report = {"backend": type(stack.controller.storage_backend).__name__}
        report["startup"] = describe(stack.cache.take_events())
        report["first"] = store_watching_acks(stack, FIRST)
        report["detach_ok"] = stack.cache.detach_storage_backend()[0]
        report["detach"] = describe(stack.cache.take_events())
    return report


@pytest.fixture(scope="module")
def cp2(tmp_path_factory) -> List[Dict[str, Any]]:
    return run_ranks(2, events_run, str(tmp_path_factory.mktemp("l3events")))


def _media(events: List[Dict[str, Any]]) -> List[tuple]:
    return [(e["type"], e.get("medium")) for e in events]


def _disk_stored(events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [e for e in events if e["type"] == "BlockStored" and e["medium"] == "DISK"]


def test_a_storage_write_publishes_one_disk_chain_after_every_rank_acked(cp2):
    first = cp2[0]["first"]
    assert _media(first["events"]) == [
        ("BlockStored", "GPU"), ("BlockStored", "CPU_PINNED"), ("BlockStored", "DISK"),
    ]  # fmt: skip
    host, disk = first["events"][1], first["events"][2]
    assert disk["hashes"] == host["hashes"] and len(disk["hashes"]) == len(FIRST) // PAGE
    assert disk["parent"] is None and disk["tokens"] == FIRST
    # rank 0 finished its own writes first and drained them; the MIN held the event back
    assert first["held_back"] >= 1


def test_only_the_publisher_rank_records(cp2):
    for name in ("first", "second", "third"):
        assert cp2[1][name]["events"] == [], name
    assert cp2[1]["clear"] == [] and cp2[1]["detach"] == []


def test_a_write_failing_on_the_publisher_s_pages_is_published_up_to_them(cp2):
    report = cp2[0]
    assert report["second_failed_writes"] >= 1
    disk = _disk_stored(report["second"]["events"])
    host = [e for e in report["second"]["events"] if e.get("medium") == "CPU_PINNED"][0]
    cut = report["second_cut"]
    assert 0 < cut < len(SECOND) // PAGE, f"the request must start on rank 1's lane ({cut})"
    assert [h for e in disk for h in e["hashes"]] == host["hashes"][:cut]
    assert [t for e in disk for t in e["tokens"]] == SECOND[: cut * PAGE]


def test_a_clear_retracts_every_block_published_on_the_tier(cp2):
    report = cp2[0]
    stored = [h for name in ("first", "second") for e in _disk_stored(report[name]["events"]) for h in e["hashes"]]
    assert report["clear"] == [{"type": "BlockRemoved", "medium": "DISK", "hashes": stored}]


def test_a_detach_retracts_the_blocks_stored_since(cp2):
    report = cp2[0]
    assert report["detach_ok"]
    stored = [h for e in _disk_stored(report["third"]["events"]) for h in e["hashes"]]
    assert len(stored) == len(THIRD) // PAGE
    assert report["detach"] == [{"type": "BlockRemoved", "medium": "DISK", "hashes": stored}]


def test_a_mooncake_write_publishes_external_and_its_detach_retracts_it():
    pytest.importorskip("mooncake.store", reason="mooncake-transfer-engine-non-cuda missing")
    from sglang_cp_hicache.testing.v0_5_23.storage import MooncakeMaster, free_ports

    with MooncakeMaster(*free_ports(2)) as master:
        publisher, other = run_ranks(2, mooncake_run, master.client_config())
    events = publisher["first"]["events"]
    assert _media(events) == [("BlockStored", "GPU"), ("BlockStored", "CPU_PINNED"), ("BlockStored", "EXTERNAL")]
    assert events[2]["hashes"] == events[1]["hashes"] and events[2]["tokens"] == FIRST
    assert publisher["detach"] == [{"type": "BlockRemoved", "medium": "EXTERNAL", "hashes": events[2]["hashes"]}]
    assert other["first"]["events"] == [] and other["detach"] == []


def test_flag_off_publishes_no_l3_event(tmp_path):
    (report,) = run_ranks(1, flag_off_run, str(tmp_path))
    assert report["backend"] == "HiCacheFile"
    assert _media(report["first"]["events"]) == [("BlockStored", "GPU"), ("BlockStored", "CPU_PINNED")]
    assert report["detach_ok"] and report["detach"] == []
