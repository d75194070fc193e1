"""The Mooncake L3 store under CP shared KV: upstream's ``MooncakeStore`` with every object
key prefixed by the plugin's owner-free namespace id.

0.5.23's MLA keys carry no cp rank when DCP is off (``mla_suffix`` is "" or the PP rank,
``mooncake_store.py:632-636``), so they are already owner-free; what they lack is the KV
dtype and host layout (only an optional tag and the model name, via ``config_prefix``).
:class:`OwnerFreeMooncakeStore` adds :class:`core.storage_keys.StorageNamespace`'s id in
front of upstream's tagged key, through ``_tag_keys``, the one place upstream prefixes
every key (batch exists, get, set, v2 component keys). Components stay upstream's object
names (``_k`` for KV, ``_indexer`` for the DSA indexer): one Mooncake object each, so an
evicted component is a miss of that page on its own.

Startup: before upstream's setup, :func:`probe_master` opens one TCP connection to the
master address (bounded, :data:`MASTER_PROBE_TIMEOUT_S`), so an unreachable master stops
startup in seconds with a message naming ``host:port``; upstream's client setup against a
closed port otherwise retries inside Mooncake before it fails (measured in
``docs/l3_storage.md``).

Mid-run: once the master is gone, each client RPC blocks about 4.3 s inside Mooncake
before it returns ``RPC_FAIL`` (measured; the plugin cannot bound a call in flight). So
after the first batch that fails that way, :class:`MasterOutage` answers every batch
exists / get / put as failed without calling the client (each a miss, or a backup that
stops, and upstream's backup thread acks it), counting them, until a bounded TCP probe
finds the master listening again.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, List, Optional, Tuple

from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from sglang_cp_hicache.core.storage_keys import StorageNamespace
from sglang_cp_hicache.v0_5_23.cache.plugin_metrics import L3Health

logger = logging.getLogger(__name__)

#: How long startup keeps trying to reach the master (a master started together with the
#: server may come up a moment later), and the wait between attempts.
MASTER_PROBE_TIMEOUT_S = 3.0
MASTER_PROBE_RETRY_S = 0.2


class MooncakeMasterUnreachable(ConnectionError):
    """The Mooncake master named by the storage config accepts no TCP connection."""


def master_host_port(address: Optional[str]) -> Optional[Tuple[str, int]]:
    """``(host, port)`` of a plain ``host:port`` master address, else None (no address, or
    a form upstream resolves otherwise, e.g. an HA ``etcd://`` list: not probed)."""
    if not address or "://" in address or "," in address:
        return None
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def probe_master(address: str, timeout_s: float = MASTER_PROBE_TIMEOUT_S) -> None:
    """Return once ``address`` (``host:port``) accepts a TCP connection; raise
    :class:`MooncakeMasterUnreachable` naming it after ``timeout_s``."""
    target = master_host_port(address)
    if target is None:
        return
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection(target, timeout=max(remaining, 0.05)):
                return
        except OSError as exc:
            if time.monotonic() + MASTER_PROBE_RETRY_S >= deadline:
                raise MooncakeMasterUnreachable(
                    f"cp_hicache: the Mooncake master at {target[0]}:{target[1]} "
                    f"(master_server_address) accepts no connection after {timeout_s:.1f} s "
                    f"({exc}); start mooncake_master there or fix "
                    "--hicache-storage-backend-extra-config / MOONCAKE_MASTER"
                ) from exc
            time.sleep(MASTER_PROBE_RETRY_S)


#: Mooncake's ErrorCode::RPC_FAIL: what every client call returns once the master is gone.
RPC_FAIL = -900
#: While the master is down, how often one call may probe it (TCP connect, bounded).
OUTAGE_RECHECK_S = 1.0
OUTAGE_PROBE_TIMEOUT_S = 0.2


@dataclass
class MasterOutage:
    """Whether the master is known down, and what the store answered without it.

    Shared by the backup and prefetch threads (one lock). Invariant: while ``down``, no
    batch reaches the Mooncake client except after a probe that found the master
    listening; every such batch is answered ``RPC_FAIL`` for each key and counted.
    """

    address: Optional[str]
    down: bool = False
    failed_batches: int = 0  # batches the client answered RPC_FAIL
    skipped_batches: int = 0  # batches answered RPC_FAIL without calling the client
    outages: int = 0
    reconnects: int = 0  # probes that found the master listening again (after an outage or a stale link)
    _next_probe: float = 0.0
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def call(self, operation: str, key_count: int, client_call: Callable[[], Any]) -> Any:
        """``client_call()`` (one batch of ``key_count`` keys) unless the master is down."""
        if not self._may_call():
            return [RPC_FAIL] * key_count
        results = client_call()
        if key_count and all(result == RPC_FAIL for result in results):
            with self._lock:
                self.failed_batches += 1
                known_down = self.down
            if not known_down and self._listens():  # a stale link to a restarted master
                results = client_call()
                if not all(result == RPC_FAIL for result in results):
                    self._reconnected(operation)
                    return results
            self._record_failure(operation)
        return results

    def _listens(self) -> bool:
        """Whether the master takes connections. Asked when a batch failed while it was
        thought up: a master restarted since this rank's last batch leaves the client's
        link stale (its next batch reconnects), so the batch goes out once more instead
        of a second of L3 being lost to a spurious outage."""
        try:
            probe_master(self.address or "", timeout_s=OUTAGE_PROBE_TIMEOUT_S)
        except MooncakeMasterUnreachable:
            return False
        return True

    def _reconnected(self, operation: str) -> None:
        with self._lock:
            self.reconnects += 1
        logger.warning(
            "cp_hicache L3 mooncake: %s failed with RPC_FAIL while the master at %s listens "
            "(restarted): sent once more, served", operation, self.address,
        )

    def _may_call(self) -> bool:
        with self._lock:
            if not self.down:
                return True
            now = time.monotonic()
            if now < self._next_probe:
                self.skipped_batches += 1
                return False
            self._next_probe = now + OUTAGE_RECHECK_S
        try:
            probe_master(self.address or "", timeout_s=OUTAGE_PROBE_TIMEOUT_S)
        except MooncakeMasterUnreachable:
            with self._lock:
                self.skipped_batches += 1
            return False
        with self._lock:
            self.down = False
            self.reconnects += 1
        logger.warning("cp_hicache L3 mooncake: the master at %s listens again", self.address)
        return True

    def _record_failure(self, operation: str) -> None:
        with self._lock:
            if self.down:
                return
            self.down = True
            self.outages += 1
            self._next_probe = time.monotonic() + OUTAGE_RECHECK_S
        logger.error(
            "cp_hicache L3 mooncake: %s failed with RPC_FAIL: the master at %s is "
            "unreachable; L3 reads and writes are misses until it listens again",
            operation,
            self.address,
        )


class OwnerFreeMooncakeStore(MooncakeStore):
    """Invariant: every key this store touches starts with ``<namespace id>_``; no batch
    reaches the client while :attr:`outage` knows the master is down."""

    #: The KV events' medium of this tier (``storage/l3_events.py``).
    EVENT_MEDIUM: ClassVar[str] = StorageMedium.EXTERNAL

    def __init__(self, storage_config: HiCacheStorageConfig, namespace: StorageNamespace):
        self.namespace = namespace
        # The config upstream's __init__ is about to load (extra config, file or env).
        address = self._load_config(storage_config).master_server_address
        probe_master(address)
        self.outage = MasterOutage(address)
        super().__init__(storage_config)

    # The three seams through which upstream's batch paths reach the client.
    def _batch_exist(self, key_strs: List[str]) -> List[int]:
        parent = super()._batch_exist
        return self.outage.call("batch exists", len(key_strs), lambda: parent(key_strs))

    def _get_batch_zero_copy_impl(
        self, key_strs: List[str], buffer_ptrs: List[Any], buffer_sizes: List[Any]
    ) -> List[int]:
        parent = super()._get_batch_zero_copy_impl
        return self.outage.call(
            "batch get", len(key_strs), lambda: parent(key_strs, buffer_ptrs, buffer_sizes)
        )

    def _put_batch_zero_copy_impl(self, key_strs: List[str], *args: Any, **kwargs: Any) -> List[int]:
        parent = super()._put_batch_zero_copy_impl
        return self.outage.call(
            "batch put", len(key_strs), lambda: parent(key_strs, *args, **kwargs)
        )

    def l3_health(self) -> L3Health:
        """This store's counts for the plugin's metrics (``cache/plugin_metrics.py``)."""
        outage = self.outage
        return L3Health(
            outages=outage.outages, reconnects=outage.reconnects,
            failed_batches=outage.failed_batches, skipped_batches=outage.skipped_batches,
        )  # fmt: skip

    def _tag_keys(self, keys: List[str]) -> List[str]:
        prefix = self.namespace.namespace_id
        return [f"{prefix}_{key}" for key in super()._tag_keys(keys)]


__all__ = [
    "MASTER_PROBE_TIMEOUT_S",
    "MasterOutage",
    "MooncakeMasterUnreachable",
    "OwnerFreeMooncakeStore",
    "master_host_port",
    "probe_master",
]
