"""The serving harness's KV event check, run by ``scenarios.py``'s ``kv_events``: each
prefill's stream read over ZMQ while the scenario runs (``testing/kv_events.py``), its prefix
set rebuilt, each request's cached tokens predicted from it before the request is sent, and
the streams' blocks of the scenario's own prompts compared medium by medium
(``docs/metrics.md``, "KV events").

A stream is read from the moment :class:`EventsWatch` subscribes: what a server published
before (other scenarios) is not seen, so only blocks under the scenario's own prompts are
compared (prompts no other scenario sends).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Callable, Dict, Iterable, List, Sequence, Set

from sglang_cp_hicache.testing.kv_events import (
    STORAGE_MEDIA,
    BlockEvent,
    CachedTokens,
    KVEventSubscriber,
    PrefixIndex,
)
from sglang_cp_hicache.testing.server.client import TIERS
from sglang_cp_hicache.testing.server.cluster import Server
from sglang_cp_hicache.testing.server.launch import LOGICAL_TOKENS, PAGE_SIZE
from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession, warm_up

if TYPE_CHECKING:  # scenarios.py runs this check: it hands its own recorder and helpers in
    from sglang_cp_hicache.testing.server.scenarios import Recorder

#: A SUB socket joins its PUB asynchronously: batches published before this are lost.
SUBSCRIBE_S = 1.0
#: A stream is settled once no batch arrived for this long.
QUIET_S = 1.5
#: Upstream's L3 prefetch threshold (``--hicache-storage-prefetch-threshold``'s default).
STORAGE_PREFETCH_THRESHOLD = 256


@dataclass
class SideStream:
    """One server's stream as read so far and the prefix set rebuilt from it."""

    subscriber: KVEventSubscriber
    index: PrefixIndex = field(default_factory=lambda: PrefixIndex(PAGE_SIZE))
    events: List[BlockEvent] = field(default_factory=list)

    def read(self, quiet_s: float, timeout_s: float) -> int:
        batch = self.subscriber.drain(quiet_s=quiet_s, timeout_s=timeout_s)
        self.events += batch
        self.index.apply(batch)
        return len(batch)


class EventsWatch:
    """Both sides' streams (``endpoints``: side name -> the publisher's ZMQ endpoint)."""

    def __init__(self, endpoints: Dict[str, str]) -> None:
        self.sides = {name: SideStream(KVEventSubscriber(url)) for name, url in endpoints.items()}
        time.sleep(SUBSCRIBE_S)
        self.settle()
        for side in self.sides.values():  # what other scenarios left in flight: not ours
            side.events.clear()

    def settle(self, quiet_s: float = QUIET_S, timeout_s: float = 30.0) -> None:
        """Read every side until its stream has been quiet for ``quiet_s``."""
        for side in self.sides.values():
            side.read(quiet_s, timeout_s)

    def predict(self, token_ids: Sequence[int], storage_threshold: int) -> Dict[str, CachedTokens]:
        return {name: side.index.predict(token_ids, storage_threshold) for name, side in self.sides.items()}

    def wait_held(
        self, name: str, media: Sequence[str], token_ids: Sequence[int], wake: Callable[[], None], timeout_s: float = 60.0
    ) -> bool:
        """Read ``name``'s stream until every full page of ``token_ids`` is held on one of
        ``media`` (False after ``timeout_s``), calling ``wake`` between reads (an idle
        scheduler polls no write acks)."""
        side = self.sides[name]
        pages = len(token_ids) // PAGE_SIZE
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            blocks = side.index.chain(list(token_ids) + [0])
            if len(blocks) == pages and all(side.index.holds(media, b) for b in blocks):
                return True
            wake()
            side.read(0.5, 1.0)
        return False

    def blocks_of(self, name: str, prompts: Iterable[Sequence[int]]) -> Set[int]:
        """The blocks ``name``'s stream named for the full pages of ``prompts``."""
        index = self.sides[name].index
        return {block for prompt in prompts for block in index.chain(list(prompt) + [0])}

    def sequence(self, name: str, medium: str, prompts: Iterable[Sequence[int]]) -> List[BlockEvent]:
        """``name``'s events on ``medium`` about the blocks of ``prompts``, in stream order,
        flushes included."""
        ours = self.blocks_of(name, prompts)
        return [
            e for e in self.sides[name].events
            if e.kind == "cleared" or (e.medium == medium and e.block_hash in ours)
        ]  # fmt: skip

    def count(self, name: str, kind: str, media: Sequence[str]) -> int:
        """How many ``kind`` block events ``name``'s stream carried on ``media``."""
        return sum(1 for e in self.sides[name].events if e.kind == kind and e.medium in media)

    def gaps(self) -> Dict[str, int]:
        return {name: side.subscriber.gaps for name, side in self.sides.items()}

    def close(self) -> None:
        for side in self.sides.values():
            side.subscriber.close()

    def __enter__(self) -> "EventsWatch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def differing_tiers(predicted: CachedTokens, reported: Dict[str, int], tiers: Sequence[str] = TIERS) -> List[str]:
    """The tiers where ``predicted`` and a server's ``cached_tokens_details`` differ."""
    return [t for t in tiers if getattr(predicted, t) != reported.get(t, 0)]


def _send(rec: Recorder, watch: EventsWatch, label: str, ids: List[int], cold: bool = False) -> None:
    """``ids`` to both sides, each side's cached tokens predicted from its stream first (both
    have an L3 tier); a problem where a server reports other than predicted."""
    watch.settle()
    predicted = watch.predict(ids, STORAGE_PREFETCH_THRESHOLD)
    for side, completion in zip((SHARDED, REFERENCE), rec.pair(label, ids, cold=cold)):
        if completion is not None and differing_tiers(predicted[side], completion.cached_by_tier):
            rec.expect(False, f"{label}, {side}: predicted {predicted[side]}, reported {completion.cached_by_tier}")


def check_kv_events(
    rec: Recorder, session: ServingSession, tokens: Callable[[str, int], List[int]], flush: Callable[[Server], bool]
) -> None:
    """Both prefills' streams while a prompt is cached, extended, evicted to host by fillers and
    loaded back: the sharded group's one stream names the prompt's blocks on GPU and
    CPU_PINNED as the reference's does, in the same order; its L3 events name them on the
    L3 medium; then, the sharded side flushed (the reference kept, so both reuse the same
    prefix length), its storage hit is predicted from them. Every request's cached tokens
    by tier are predicted from each stream before it is sent and must be what it reports
    (``rec``: the scenario's recorder; ``tokens``, ``flush``: its prompt and flush helpers)."""
    prompt = tokens("events", 12 * PAGE_SIZE)
    extended = prompt + tokens("events:page", PAGE_SIZE + 10)
    servers = {SHARDED: session.sharded, REFERENCE: session.reference}
    with EventsWatch({side: server.endpoint.kv_events_url for side, server in servers.items()}) as watch:
        _send(rec, watch, "cold", prompt, cold=True)
        _send(rec, watch, "extended", extended)
        for i in range(LOGICAL_TOKENS // (25 * PAGE_SIZE) + 1):  # past the logical device pool
            _send(rec, watch, f"filler {i}", tokens(f"events:filler:{i}", 25 * PAGE_SIZE))
        _send(rec, watch, "revisit", prompt + tokens("events:again", 30))
        wake = partial(warm_up, session.sharded_router)  # under a page: caches nothing, polls acks
        held = watch.wait_held(SHARDED, STORAGE_MEDIA, extended, wake)
        rec.expect(held, "the sharded stream never named the prompt's full pages on an L3 medium")
        rec.note(f"L3: {watch.count(SHARDED, 'stored', STORAGE_MEDIA)} BlockStored on {'/'.join(STORAGE_MEDIA)}")
        for router in (session.sharded_router, session.reference_router):
            warm_up(router)  # both schedulers poll their last host-write acks
        watch.settle()
        for medium in ("GPU", "CPU_PINNED"):
            a, b = (watch.sequence(side, medium, [extended]) for side in servers)
            rec.expect(a == b, f"{medium}: the sharded stream's {len(a)} block events differ from the reference's {len(b)}")
            rec.note(f"{medium}: {len(a)} block events of the prompt, equal on both sides" if a == b else f"{medium} differs")
        rec.expect(flush(session.sharded), f"/flush_cache failed on {session.sharded.name}")
        _send(rec, watch, "after flush", prompt + tokens("events:flushed", 25))
        rec.expect(watch.gaps() == {SHARDED: 0, REFERENCE: 0}, f"batches lost: {watch.gaps()}")


__all__ = ["EventsWatch", "QUIET_S", "SUBSCRIBE_S", "check_kv_events", "differing_tiers"]
