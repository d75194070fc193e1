"""A small KV-aware subscriber of SGLang's KV events (``--kv-events-config``), test-side.

It does what a KV-aware router does with the stream, and nothing more:

* :class:`KVEventSubscriber`: a ZMQ SUB socket on a server's publisher
  (``ZmqEventPublisher``: frames ``topic, seq, payload``; the payload a msgpack
  ``KVEventBatch``, ``[ts, events, attn_dp_rank]``, each event a tagged map), read into
  :class:`BlockEvent` s, one per block in stream order (batches and coalesced events split:
  two streams that did the same work compare equal however their batches fell);
* :class:`PrefixIndex`: the prefix set per medium rebuilt from them: which blocks each
  medium holds (``GPU``, ``CPU_PINNED``, and the plugin's L3 media ``DISK`` / ``EXTERNAL``),
  and which block a page of tokens is under a parent (``BlockStored`` carries the tokens, so
  no hash function is reimplemented); :meth:`PrefixIndex.predict` turns a prompt into the
  cached tokens a server will report, by tier (``meta_info.cached_tokens_details``).

Semantics it assumes (``docs/metrics.md``, "KV events"): ``AllBlocksCleared`` (a flush)
clears the device and host media; L3 blocks survive a flush (the tier keeps its pages) and
leave only by their own ``BlockRemoved``. SGLang-free: it reads the wire format only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

DEVICE_MEDIA = ("GPU",)
HOST_MEDIA = ("CPU_PINNED",)
STORAGE_MEDIA = ("DISK", "EXTERNAL")
#: Media a flush (``AllBlocksCleared``) empties: the L3 tier keeps its pages.
FLUSHED_MEDIA = DEVICE_MEDIA + HOST_MEDIA


@dataclass(frozen=True)
class BlockEvent:
    """One block's event: ``kind`` "stored", "removed" or "cleared" (then no block);
    ``parent`` and ``tokens`` for a stored block only."""

    kind: str
    medium: Optional[str] = None
    block_hash: Optional[int] = None
    parent: Optional[int] = None
    tokens: Tuple[int, ...] = ()


def block_events(events: Iterable[Mapping[str, Any]]) -> List[BlockEvent]:
    """Decoded events (tagged maps, ``msgspec.to_builtins`` of SGLang's structs or the
    wire's msgpack) as one :class:`BlockEvent` per block, in order."""
    out: List[BlockEvent] = []
    for event in events:
        kind, medium = event["type"], event.get("medium") or "GPU"  # upstream's default medium
        if kind == "AllBlocksCleared":
            out.append(BlockEvent("cleared"))
        elif kind == "BlockRemoved":
            out += [BlockEvent("removed", medium, h) for h in event["block_hashes"]]
        elif kind == "BlockStored":
            size, tokens, parent = event["block_size"], list(event["token_ids"]), event["parent_block_hash"]
            for index, block_hash in enumerate(event["block_hashes"]):
                page = tuple(tokens[index * size : (index + 1) * size])
                out.append(BlockEvent("stored", medium, block_hash, parent, page))
                parent = block_hash
        else:
            raise ValueError(f"unknown KV event type {kind!r}")
    return out


@dataclass(frozen=True)
class CachedTokens:
    """A prompt's predicted cached tokens by tier (a server's ``cached_tokens_details``)."""

    device: int = 0
    host: int = 0
    storage: int = 0

    @property
    def total(self) -> int:
        return self.device + self.host + self.storage


@dataclass
class PrefixIndex:
    """The blocks each medium holds and the block chain by (parent, page tokens), rebuilt
    from a stream's :class:`BlockEvent` s (:meth:`apply`, in order)."""

    page_size: int
    held: Dict[str, Set[int]] = field(default_factory=dict)
    children: Dict[Tuple[Optional[int], Tuple[int, ...]], int] = field(default_factory=dict)

    def apply(self, events: Iterable[BlockEvent]) -> None:
        for event in events:
            if event.kind == "cleared":
                for medium in FLUSHED_MEDIA:
                    self.held.pop(medium, None)
            elif event.kind == "stored":
                self.held.setdefault(event.medium, set()).add(event.block_hash)
                self.children[(event.parent, event.tokens)] = event.block_hash
            else:
                self.held.get(event.medium, set()).discard(event.block_hash)

    def holds(self, media: Sequence[str], block_hash: int) -> bool:
        return any(block_hash in self.held.get(medium, ()) for medium in media)

    def chain(self, token_ids: Sequence[int]) -> List[int]:
        """The known blocks of ``token_ids``'s matchable full pages (at most all but its
        last token, SGLang's ``_compute_max_prefix_len``), from the first, until one is
        unknown."""
        blocks: List[int] = []
        parent: Optional[int] = None
        for page in range((len(token_ids) - 1) // self.page_size):
            tokens = tuple(token_ids[page * self.page_size : (page + 1) * self.page_size])
            block = self.children.get((parent, tokens))
            if block is None:
                break
            blocks.append(block)
            parent = block
        return blocks

    def predict(self, token_ids: Sequence[int], storage_threshold: int = 0) -> CachedTokens:
        """Cached tokens of ``token_ids`` by tier: the device prefix, then the pages on host,
        then the pages in L3 (a storage hit under ``storage_threshold`` tokens is not
        fetched: upstream's prefetch threshold)."""
        tiers = [0, 0, 0]
        tier = 0
        for block in self.chain(token_ids):
            while tier < 3 and not self.holds((DEVICE_MEDIA, HOST_MEDIA, STORAGE_MEDIA)[tier], block):
                tier += 1
            if tier == 3:
                break
            tiers[tier] += self.page_size
        if tiers[2] < storage_threshold:
            tiers[2] = 0
        return CachedTokens(*tiers)


class KVEventSubscriber:
    """A ZMQ SUB socket on one publisher (``tcp://host:port``), all topics; sequence
    numbers checked (a gap means the stream lost batches: :attr:`gaps`)."""

    def __init__(self, endpoint: str, topic: str = "") -> None:
        import zmq

        self._zmq = zmq
        self._context = zmq.Context.instance()
        self._socket = self._context.socket(zmq.SUB)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt_string(zmq.SUBSCRIBE, topic)
        self._socket.connect(endpoint)
        self.endpoint = endpoint
        self.last_seq: Optional[int] = None
        self.gaps = 0
        self.batches = 0

    def _receive(self, timeout_s: float) -> Optional[List[BlockEvent]]:
        import msgspec

        if not self._socket.poll(int(timeout_s * 1000)):
            return None
        _topic, seq_bytes, payload = self._socket.recv_multipart()
        seq = int.from_bytes(seq_bytes, "big", signed=True)
        if self.last_seq is not None and seq != self.last_seq + 1:
            self.gaps += 1
        self.last_seq = seq
        self.batches += 1
        _ts, events, _dp_rank = msgspec.msgpack.decode(payload)
        return block_events(events)

    def drain(self, quiet_s: float = 1.0, timeout_s: float = 30.0) -> List[BlockEvent]:
        """Every block event until none arrived for ``quiet_s`` (or ``timeout_s`` passed)."""
        deadline = time.monotonic() + timeout_s
        out: List[BlockEvent] = []
        while time.monotonic() < deadline:
            batch = self._receive(min(quiet_s, max(deadline - time.monotonic(), 0.0)))
            if batch is None:
                break
            out += batch
        return out

    def close(self) -> None:
        self._socket.close(0)

    def __enter__(self) -> "KVEventSubscriber":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def without_media(events: Iterable[BlockEvent], media: Sequence[str]) -> List[BlockEvent]:
    """``events`` without those on ``media`` (e.g. a stream compared on GPU and CPU_PINNED
    only)."""
    return [e for e in events if e.kind == "cleared" or e.medium not in media]


__all__ = [
    "BlockEvent",
    "CachedTokens",
    "DEVICE_MEDIA",
    "FLUSHED_MEDIA",
    "HOST_MEDIA",
    "KVEventSubscriber",
    "PrefixIndex",
    "STORAGE_MEDIA",
    "block_events",
    "without_media",
]
