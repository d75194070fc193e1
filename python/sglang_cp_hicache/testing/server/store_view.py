"""The Mooncake store as the fleet scenario sees it: the master's keys and counters (its HTTP
API: ``/get_all_keys``, ``/metrics``), objects read back by key through a client of the
harness's own that mounts no segment, and the puts each prefill rank logged by key (the
0.5.23 runtime's ``L3 puts`` step: ``testing/v0_5_23/server_runtime.py``).

An object key holds its page's storage hash (64 hex digits, SGLang's hash chain); the rest of
the key (namespace, component suffix) is the same for every page of one component. Pages
and components are read from keys that way, nothing else is assumed of their spelling.
"""

from __future__ import annotations

import json
import re
import urllib.parse
import urllib.request
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Dict, Iterable, List, Mapping, Optional, Set, Tuple

from sglang_cp_hicache.testing.server.cluster import MooncakeMaster
from sglang_cp_hicache.testing.server.metrics import Metrics

#: A Mooncake transfer engine's or store client's endpoint, as its process logs it.
MOONCAKE_LISTENS = re.compile(r"listening on (127\.\d+\.\d+\.\d+:\d+)")

PAGE_HASH = re.compile(r"(?<![0-9a-f])[0-9a-f]{64}(?![0-9a-f])")
#: What the 0.5.23 runtime's put lines start with, then ``tp rank R put N failed F: keys``.
PUT_LINE = re.compile(r"cp_hicache L3 puts \(CPU runtime step\): tp rank (\d+) put (\d+) failed (\d+):(.*)$")
READER_BUFFER_BYTES = 64 << 20  # the reading client's local buffer: above any one object
HTTP_TIMEOUT_S = 10.0


def page_of(key: str) -> str:
    """The page hash a key holds (ValueError for a key without one)."""
    found = PAGE_HASH.search(key)
    if found is None:
        raise ValueError(f"no page hash in store key {key!r}")
    return found.group(0)


def component_of(key: str) -> str:
    """The key with its page hash blanked: the same for every page of one component."""
    return PAGE_HASH.sub("*", key, count=1)


def by_page(keys: Iterable[str]) -> Dict[str, Set[str]]:
    pages: Dict[str, Set[str]] = defaultdict(set)
    for key in keys:
        pages[page_of(key)].add(key)
    return dict(pages)


@dataclass(frozen=True)
class Put:
    """One logged put batch of one rank: every key it put, how many the client failed (a
    key the master already held is no failure: the master's counters tell those apart)."""

    rank: int
    keys: Tuple[str, ...]
    failed: int


def logged_puts(log_text: str, since_line: int = 0) -> List[Put]:
    """The put batches a server logged from line ``since_line`` on."""
    puts = []
    for line in log_text.splitlines()[since_line:]:
        match = PUT_LINE.search(line)
        if match is not None:
            keys = tuple(match.group(4).split())
            if len(keys) != int(match.group(2)):
                raise ValueError(f"a put line names {len(keys)} keys, says {match.group(2)}: {line[:200]}")
            puts.append(Put(int(match.group(1)), keys, int(match.group(3))))
    return puts


def put_by_rank(puts: Iterable[Put]) -> Dict[int, List[str]]:
    """Every key each rank put, in order (a key twice in one list: put twice)."""
    ranks: Dict[int, List[str]] = defaultdict(list)
    for put in puts:
        ranks[put.rank].extend(put.keys)
    return dict(ranks)


def owner_problems(
    put: Mapping[int, List[str]], keys: Set[str], want_pages: Optional[Mapping[int, int]] = None
) -> List[str]:
    """What is wrong with ``put`` (one instance's keys by rank) as the writes of ``keys``:
    every key put once, by one rank; each page's components by one rank; rank ``r`` the
    writer of ``want_pages[r]`` pages when given. Empty when nothing is."""
    problems = []
    counts = Counter(key for rank_keys in put.values() for key in rank_keys)
    twice = sorted(key for key, n in counts.items() if n > 1)
    if twice:
        problems.append(f"{len(twice)} keys put more than once, e.g. {twice[0]}")
    if set(counts) != keys:
        problems.append(f"put {len(counts)} keys, the store gained {len(keys)} ({len(set(counts) ^ keys)} differ)")
    writers: Dict[str, Set[int]] = defaultdict(set)
    for rank, rank_keys in put.items():
        for key in rank_keys:
            writers[page_of(key)].add(rank)
    shared = [page for page, ranks in writers.items() if len(ranks) > 1]
    if shared:
        problems.append(f"{len(shared)} pages written by more than one rank")
    pages = {rank: len({page_of(key) for key in rank_keys}) for rank, rank_keys in put.items()}
    if want_pages is not None and {r: n for r, n in pages.items() if n} != {r: n for r, n in want_pages.items() if n}:
        problems.append(f"pages written per rank {pages}, owned per rank {dict(want_pages)}")
    return problems


def byte_twins(first: Mapping[str, bytes], second: Mapping[str, bytes]) -> Optional[str]:
    """Why the objects ``second`` (keys of other pages: another hash chain over the same
    tokens) are not byte for byte those of ``first``, per component; None when they are."""
    if any(not value for value in (*first.values(), *second.values())):
        return "an object read back empty"
    one = Counter((component_of(key), value) for key, value in first.items())
    two = Counter((component_of(key), value) for key, value in second.items())
    if one != two:
        return f"{sum((one - two).values())} of {len(first)} objects have no byte-identical twin"
    return None


@dataclass(frozen=True)
class StoreCounts:
    """The master's counters: objects, bytes allocated to them, objects written (puts the
    master ended) and puts it refused at their start (a key it already held, or one
    another client was putting)."""

    objects: int
    bytes: int
    written: int
    refused: int

    @classmethod
    def of(cls, metrics: Metrics) -> "StoreCounts":
        def count(single: str, batch: str) -> int:
            return int(metrics.total(single) + metrics.total(batch))

        written = count("master_put_end_requests_total", "master_batch_put_end_items_total")
        refused = count("master_put_start_failures_total", "master_batch_put_start_failed_items_total")
        return cls(int(metrics.total("master_key_count")), int(metrics.total("master_allocated_bytes")), written, refused)


class StoreView:
    """One master's keys, counters and objects; :meth:`close` ends the reading client."""

    def __init__(self, master: MooncakeMaster):
        self.master = master
        self._client = None

    @property
    def http(self) -> str:
        return self.master.http

    def keys(self) -> Set[str]:
        with urllib.request.urlopen(f"{self.http}/get_all_keys", timeout=HTTP_TIMEOUT_S) as response:
            return {line.strip() for line in response.read().decode().splitlines() if line.strip()}

    def segments(self) -> List[str]:
        """The segments mounted on the master (``/get_all_segments``: one name a line);
        empty while it does not answer."""
        try:
            with urllib.request.urlopen(f"{self.http}/get_all_segments", timeout=HTTP_TIMEOUT_S) as response:
                return [line.strip() for line in response.read().decode().splitlines() if line.strip()]
        except OSError:
            return []

    def placement(self, keys: Iterable[str]) -> Counter:
        """How many of ``keys``' replicas each segment holds, by the segment's transport
        endpoint (``/query_key``): Mooncake places an object in any mounted segment, and a
        client that leaves takes what its segments hold with it."""
        found: Counter = Counter()
        for key in keys:
            with urllib.request.urlopen(f"{self.http}/query_key?key={urllib.parse.quote(key, safe='')}", timeout=HTTP_TIMEOUT_S) as response:
                for replica in json.loads(response.read().decode()).get("data") or []:
                    found[replica.get("transport_endpoint_", "?")] += 1
        return found

    def held_by(self, keys: Iterable[str], logs: Mapping[str, str]) -> Counter:
        """:meth:`placement` by process name: each transport endpoint named from the
        ``listening on HOST:PORT`` lines of that process's Mooncake log (``logs``: name ->
        log text); an endpoint no log names stays as it is."""
        owners = {endpoint: name for name, text in logs.items() for endpoint in MOONCAKE_LISTENS.findall(text)}
        by_owner: Counter = Counter()
        for endpoint, count in self.placement(keys).items():
            by_owner[owners.get(endpoint, endpoint)] += count
        return by_owner

    def counts(self) -> StoreCounts:
        return StoreCounts.of(Metrics.fetch(self.http))

    def read(self, keys: Iterable[str]) -> Dict[str, bytes]:
        """Each object's bytes, read by key (empty bytes for one the store did not give)."""
        client = self._reader()
        return {key: bytes(client.get(key)) for key in sorted(keys)}

    def _reader(self):
        if self._client is None:
            from mooncake.store import MooncakeDistributedStore

            client = MooncakeDistributedStore()
            # no segment of its own (0 bytes): it only reads the writers' segments
            code = client.setup("127.0.0.1", "P2PHANDSHAKE", 0, READER_BUFFER_BYTES, "tcp", "", self.master.address)
            if code != 0:
                raise RuntimeError(f"the harness's Mooncake reader could not join {self.master.address}: {code}")
            self._client = client
        return self._client

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None


__all__ = [
    "MOONCAKE_LISTENS",
    "Put",
    "StoreCounts",
    "StoreView",
    "by_page",
    "byte_twins",
    "component_of",
    "logged_puts",
    "owner_problems",
    "page_of",
    "put_by_rank",
]
