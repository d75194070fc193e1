"""The test-side KV-aware subscriber (``testing/kv_events.py``): events split per block in
stream order, the prefix set rebuilt per medium, a prompt's cached tokens predicted by tier,
and batches read from a real ZMQ PUB socket in SGLang's wire format."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest

from sglang_cp_hicache.testing.kv_events import (
    BlockEvent,
    CachedTokens,
    KVEventSubscriber,
    PrefixIndex,
    block_events,
    without_media,
)

PAGE = 2


def stored(hashes, tokens, medium, parent=None):
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent,
            "token_ids": tokens, "block_size": PAGE, "lora_id": None, "medium": medium}  # fmt: skip


def removed(hashes, medium):
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": medium}


def test_events_are_split_per_block_in_order_with_parent_links():
    events = block_events([stored([1, 2], [5, 6, 7, 8], "GPU", parent=9), removed([1], None), {"type": "AllBlocksCleared"}])
    assert events == [
        BlockEvent("stored", "GPU", 1, 9, (5, 6)),
        BlockEvent("stored", "GPU", 2, 1, (7, 8)),
        BlockEvent("removed", "GPU", 1),  # upstream's default medium
        BlockEvent("cleared"),
    ]
    assert without_media(events, ("GPU",)) == [BlockEvent("cleared")]
    with pytest.raises(ValueError, match="Unknown|unknown"):
        block_events([{"type": "Unknown"}])


def test_one_coalesced_event_and_its_pages_one_by_one_are_the_same_stream():
    whole = block_events([stored([1, 2, 3], [1, 2, 3, 4, 5, 6], "DISK")])
    pieces = block_events([stored([1], [1, 2], "DISK"), stored([2, 3], [3, 4, 5, 6], "DISK", parent=1)])
    assert whole == pieces


def _index(*events) -> PrefixIndex:
    index = PrefixIndex(PAGE)
    index.apply(block_events(events))
    return index


PROMPT = [1, 2, 3, 4, 5, 6, 7, 8, 9]  # four full pages, the last token never matched


def test_a_prompt_is_predicted_device_then_host_then_storage():
    index = _index(
        stored([10, 11, 12, 13], PROMPT[:8], "DISK"),
        stored([10, 11, 12], PROMPT[:6], "CPU_PINNED"),
        stored([10], PROMPT[:2], "GPU"),
    )
    assert index.predict(PROMPT) == CachedTokens(device=2, host=4, storage=2)
    assert index.predict(PROMPT[:8]) == CachedTokens(device=2, host=4, storage=0)  # 7 matchable
    assert index.predict(PROMPT, storage_threshold=4) == CachedTokens(device=2, host=4)
    assert index.predict([1, 2, 9, 9, 9]) == CachedTokens(device=2)  # another second page
    assert index.predict(PROMPT).total == 8


def test_removals_and_a_flush_shrink_the_prediction_but_l3_survives_a_flush():
    index = _index(stored([10, 11], PROMPT[:4], "GPU"), stored([10, 11], PROMPT[:4], "DISK"))
    index.apply(block_events([removed([11], "GPU")]))
    assert index.predict(PROMPT) == CachedTokens(device=2, storage=2)
    index.apply([BlockEvent("cleared")])
    assert index.predict(PROMPT) == CachedTokens(storage=4)
    index.apply(block_events([removed([10, 11], "DISK")]))
    assert index.predict(PROMPT) == CachedTokens()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_batches_from_a_pub_socket_are_read_and_a_gap_is_counted():
    import zmq

    port = _free_port()
    publisher = zmq.Context.instance().socket(zmq.PUB)
    publisher.setsockopt(zmq.LINGER, 0)
    publisher.bind(f"tcp://127.0.0.1:{port}")
    try:
        with KVEventSubscriber(f"tcp://127.0.0.1:{port}") as subscriber:
            time.sleep(0.3)  # a SUB joins a PUB asynchronously
            for seq, events in ((0, [stored([1], [1, 2], "GPU")]), (1, [removed([1], "GPU")]), (3, [])):
                payload = msgspec.msgpack.encode([time.time(), events, 0])
                publisher.send_multipart((b"", seq.to_bytes(8, "big"), payload))
            received = subscriber.drain(quiet_s=0.5, timeout_s=10)
            assert received == [BlockEvent("stored", "GPU", 1, None, (1, 2)), BlockEvent("removed", "GPU", 1)]
            assert (subscriber.batches, subscriber.gaps, subscriber.last_seq) == (3, 1, 3)
    finally:
        publisher.close(0)
