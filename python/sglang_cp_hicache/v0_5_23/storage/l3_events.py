"""KV events of the L3 tier under CP shared KV: ``BlockStored`` / ``BlockRemoved`` with the
medium ``DISK`` (the file backend) or ``EXTERNAL`` (the Mooncake store).

SGLang 0.5.23 defines both media (``disaggregation/kv_events.py:StorageMedium``) and never
emits them: a KV-aware router sees GPU and CPU_PINNED blocks only, not what L3 holds. Here,
on a sharded cache whose event recorder is on (the publisher rank, ``is_kv_publisher_rank``:
CP rank 0 of the group; every other rank's recorder is off and these hooks do nothing),
through upstream's own recorder (``mem_cache/events.py:KVCacheEventRecorder``, the tree
core's ``kv_events``), so the events reach the same ``take_events`` and publisher:

* **a storage write** (:func:`write_backup_storage_around`, when upstream queues it): the
  node's ``BlockStored`` events are made then with the recorder's own ``record_store`` on
  a scratch recorder of the same format (hashes, parent link, namespace: as the node's
  GPU and CPU_PINNED events), and held by operation id (``core.l3_event_log``);
* **its ack** (:func:`drain_storage_control_queues_impl_around`): the operations upstream
  drains from the backup ack queue are the first ``n_backup`` of it, ``n_backup`` being
  upstream's MIN over the ranks' ready acks, so an operation is published once, when every
  rank has acked it, whatever rank finished first; its events are cut to the pages
  written, the publisher's ``completed_tokens`` (owner writes, ``owner_io``: the logical
  prefix its own pages cover; a page another rank failed to write is published as stored,
  and a read of it is a miss on every rank, upstream's hit MIN, never wrong bytes). No
  collective is added;
* **a clear or a detach of the tier** (:func:`clear_storage_backend_around`,
  :func:`detach_storage_backend_around`, on every rank through the admin API): one
  ``BlockRemoved`` per medium naming every block this stream published as stored there and
  not removed since.

Evictions inside the tier are not published: the file backend's LRU evictor (opt-in,
``max_size``) runs in each rank's backup thread over the pages that rank owns, and
Mooncake's master evicts without telling its clients; neither reaches the publisher rank
without a new collective. A flush (``/flush_cache``: upstream's ``AllBlocksCleared``)
keeps the L3 tier, and its blocks stay tracked here.
"""

from __future__ import annotations

import logging
from queue import Queue
from typing import Any, Callable, List, Optional, Sequence, Tuple

import msgspec

from sglang_cp_hicache.core.l3_event_log import HeldWrite, L3EventLog
from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

logger = logging.getLogger(__name__)


def tier_medium(backend: Any) -> Optional[str]:
    """The event medium of an L3 backend (``EVENT_MEDIUM`` of the plugin's owner-free
    backends; upstream's fault injector wraps one as ``_backend``), None for any other."""
    return getattr(getattr(backend, "_backend", backend), "EVENT_MEDIUM", None)


def _publishing(cache: Any) -> Optional[Tuple[L3EventLog, Any]]:
    """``(the cache's L3 event log, its event recorder)`` on a sharded cache whose
    recorder is on (the publisher rank), else None."""
    extension = extension_of(cache)
    if extension is None or not cache.tree_core.kv_events.enabled:
        return None
    return extension.l3_events, cache.tree_core.kv_events


def stored_events(recorder: Any, node: Any, medium: str) -> List[Any]:
    """``node``'s ``BlockStored`` events on ``medium``, as ``recorder`` would record them
    (its page size, format and LoRA names), without touching its queue."""
    from sglang.srt.mem_cache.events import KVCacheEventRecorder

    scratch = KVCacheEventRecorder(
        enabled=True,
        page_size=recorder.page_size,
        dynamo_format=recorder.dynamo_format,
        lora_names=recorder.lora_names,
    )
    scratch.record_store(node, medium=medium)
    return scratch.take()


def first_blocks(events: Sequence[Any], count: int) -> List[Any]:
    """The ``BlockStored`` events of the first ``count`` blocks of ``events`` (a coalesced
    event cut inside keeps its first blocks and their tokens)."""
    kept: List[Any] = []
    for event in events:
        if count <= 0:
            break
        blocks = len(event.block_hashes)
        if blocks > count:
            event = msgspec.structs.replace(
                event,
                block_hashes=event.block_hashes[:count],
                token_ids=event.token_ids[: count * event.block_size],
            )
        kept.append(event)
        count -= min(blocks, count)
    return kept


# --------------------------------------------------------------------------- hooks
def write_backup_storage_around(original: Callable, cache: Any, node_id: Any) -> Any:
    """``UnifiedRadixCache.write_backup_storage``: when upstream queues the node's storage
    write, hold its ``BlockStored`` events until the write's ack."""
    publishing = _publishing(cache)
    if publishing is None:
        return original(cache, node_id)
    log, recorder = publishing
    in_flight = len(cache.ongoing_backup)
    result = original(cache, node_id)
    medium = tier_medium(cache.cache_controller.storage_backend)
    if len(cache.ongoing_backup) == in_flight or medium is None:
        return result  # nothing queued (no storage, or the node is not on host)
    operation_id = next(reversed(cache.ongoing_backup))  # the entry upstream just added
    events = stored_events(recorder, cache.tree_core.node_by_id(node_id), medium)
    log.hold(operation_id, HeldWrite(medium, tuple(events)))
    return result


def _queued(queue: "Queue[Any]", count: Optional[int]) -> List[Any]:
    """The first ``count`` items of ``queue`` (all of them for None), left in it."""
    with queue.mutex:
        items = list(queue.queue)
    return items if count is None else items[:count]


def drain_storage_control_queues_impl_around(
    original: Callable, cache: Any, n_storage_hit: Optional[int], n_ack_prefetch: Optional[int],
    n_backup: Optional[int], n_release: Optional[int], extra_release_counts: Any,
    log_metrics: bool,
) -> Any:  # fmt: skip
    """``UnifiedRadixCache._drain_storage_control_queues_impl``: publish the held events of
    the storage writes this drain acks (upstream drains the first ``n_backup`` of the ack
    queue: every rank's MIN), each cut to the pages it wrote."""

    def drain() -> Any:
        return original(
            cache, n_storage_hit=n_storage_hit, n_ack_prefetch=n_ack_prefetch,
            n_backup=n_backup, n_release=n_release,
            extra_release_counts=extra_release_counts, log_metrics=log_metrics,
        )  # fmt: skip

    publishing = _publishing(cache)
    controller = cache.cache_controller
    if publishing is None or controller is None or controller.ack_backup_queue is None:
        return drain()
    log, recorder = publishing
    if log.held_operations == 0:
        return drain()
    acked = [op for op in _queued(controller.ack_backup_queue, n_backup) if op.id in cache.ongoing_backup]
    result = drain()
    for operation in acked:
        write = log.release(operation.id)
        if write is None:
            continue
        events = first_blocks(write.events, operation.completed_tokens // cache.page_size)
        for event in events:
            recorder.enqueue(event)
        log.track_stored(write.medium, [h for event in events for h in event.block_hashes])
    # A drain of every rank's own queue (detach, shutdown) may take acks queued after the
    # look above; those writes, and any a reset dropped, publish nothing.
    log.forget_except(cache.ongoing_backup)
    return result


def _retract(cache: Any, why: str) -> None:
    publishing = _publishing(cache)
    if publishing is None:
        return
    from sglang.srt.disaggregation.kv_events import BlockRemoved

    log, recorder = publishing
    if log.forgotten:
        logger.warning(
            "cp_hicache L3 events: %s retracts the blocks still tracked; %d older ones "
            "were forgotten for room and are not named", why, log.forgotten,
        )  # fmt: skip
    for medium, hashes in log.retract().items():
        recorder.enqueue(BlockRemoved(block_hashes=hashes, medium=medium))


def clear_storage_backend_around(original: Callable, cache: Any) -> bool:
    """``UnifiedRadixCache.clear_storage_backend``: a cleared tier removes every block
    this stream published as stored on it."""
    cleared = original(cache)
    if cleared:
        _retract(cache, "a clear of the storage backend")
    return cleared


def detach_storage_backend_around(original: Callable, cache: Any) -> Tuple[bool, str]:
    """``UnifiedRadixCache.detach_storage_backend``: a detached tier is no longer read,
    so its blocks leave this server's stream."""
    detached, message = original(cache)
    if detached:
        _retract(cache, "a detach of the storage backend")
    return detached, message


__all__ = [
    "clear_storage_backend_around",
    "detach_storage_backend_around",
    "drain_storage_control_queues_impl_around",
    "first_blocks",
    "stored_events",
    "tier_medium",
    "write_backup_storage_around",
]
