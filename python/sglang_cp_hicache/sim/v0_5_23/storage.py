"""HiCache's L3 storage tier in the 0.5.23 simulator (``SimConfig.storage_backend``).

Parent side (:func:`open_storage`, no SGLang): the run's backend set-up. The file backend
gets one folder per column under ``SimConfig.storage_dir`` (``cp_shared_kv/``,
``upstream/``, ``upstream_logical/``; kept between runs, so a later run, at any cp size,
reads what an earlier one wrote); the Mooncake store gets a ``mooncake_master`` on
loopback per column, started here and stopped (by its pid) when the run ends (or, for the
plugin column, a store that outlives the run: ``SimConfig.storage_mooncake_master``). Columns:
``plugin`` attaches the backend with the plugin's owner-free keys, owner writes and owner
reads; ``upstream`` (cp 1, unsharded) attaches upstream's own backend; ``upstream_logical``
(``SimConfig.storage_logical_baseline``) the same with cp x the per-rank pools; ``native``
runs without storage (upstream refuses it under sharding; the report says so).

Rank side (:class:`StorageTier`): what a PD-prefill scheduler does with L3, through
upstream's cache calls:

* on arrival, the request's L3 prefetch (``Scheduler._prefetch_kvcache``,
  ``scheduler.py:3342-3393``, cache mode: match, then ``prefetch_from_storage`` of what
  follows the device + host match when the anchor is backed up or the root);
* before its match at admission, ``check_prefetch_progress`` and
  ``pop_prefetch_loaded_span`` (``scheduler.py:4240-4256``); the fetched pages are host
  nodes by then and load back like any host hit, so the driver's hit check compares them
  byte for byte with the pattern on their owners (poisoned device rows first);
* :meth:`StorageTier.settle` after the arrivals: storage I/O runs on upstream's threads and
  is drained by upstream's MIN-reduced queue drains until every rank is idle (the
  simulator's own MAX of "still busy", outside the counted path). This stands for storage
  fast enough that a prefetch ends before its request reaches admission, and a backup
  before the next step: decisions stay deterministic and identical across columns' runs.

Metered per rank: KV pages written and read through the controller's page functions (the
backup and prefetch threads call them with this rank's narrowed pages), each as a whole
page of every component (``bytes_per_token * page_size``), and pages read that an
earlier run had stored (file backend).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterator, List, Optional, Sequence, Set

import torch
import torch.distributed as dist

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import StorageRankStats

logger = logging.getLogger(__name__)

#: The backends each column can run (the plugin's proven set; upstream's own at cp 1).
BACKENDS = ("file", "mooncake")
#: Each file column's folder under SimConfig.storage_dir (``upstream_logical``: upstream
#: cp 1 with cp x the per-rank pools; a restart at another cp reads what the earlier
#: run's logical baseline stored, as the plugin reads its own earlier run's).
FOLDERS = {"plugin": "cp_shared_kv", "upstream": "upstream", "upstream_logical": "upstream_logical"}
#: Mooncake: the segment each client mounts (objects live in their writers' segments).
MOONCAKE_SEGMENT_BYTES = 256 << 20
# The masters' read lease: long enough for upstream's start-up warm-up on a loaded box
# (the segments never fill, so nothing waits on a lease to evict).
MOONCAKE_LEASE_TTL_MS = 5000
#: Bounded waits: storage that never settles stops the run instead of hanging it.
SETTLE_TIMEOUT_S = 120.0
_POLL_S = 0.001


@dataclass(frozen=True)
class StorageRun:
    """What a rank needs to attach the run's backend (picklable, handed to every rank)."""

    backend: str
    folders: Dict[str, str] = field(default_factory=dict)  # file: column name -> folder
    mooncake: Dict[str, Dict[str, Any]] = field(default_factory=dict)  # column -> extra config

    def extra_config(self, column: str) -> Dict[str, Any]:
        if self.backend == "file":
            return {"file_storage_path": self.folders[column]}
        return dict(self.mooncake[column])


@contextlib.contextmanager
def open_storage(cfg: SimConfig) -> Iterator[Optional[StorageRun]]:
    """The run's storage (None without ``cfg.storage_backend``): folders, or a local
    Mooncake master that lives exactly as long as the run."""
    if cfg.storage_backend is None:
        yield None
        return
    columns = [c for c in FOLDERS if c != "upstream_logical" or cfg.storage_logical_baseline]
    if cfg.storage_backend == "file":
        root, temporary = cfg.storage_dir, cfg.storage_dir is None
        if temporary:
            root = tempfile.mkdtemp(prefix="cp-hicache-sim-l3-")
        folders = {column: os.path.join(root, FOLDERS[column]) for column in columns}
        for folder in folders.values():
            os.makedirs(folder, exist_ok=True)
        try:
            yield StorageRun("file", folders=folders)
        finally:
            if temporary:
                shutil.rmtree(root, ignore_errors=True)
        return
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import free_ports, MooncakeMaster

    # One master per column: a master keeps a departed column's client segments
    # registered for a while and would place the next column's objects there.
    with contextlib.ExitStack() as masters:
        configs = {}
        for column in columns:
            if column == "plugin" and cfg.storage_mooncake_master is not None:
                configs[column] = held_store_client_config(cfg.storage_mooncake_master)
                continue
            master = masters.enter_context(
                MooncakeMaster(*free_ports(2), lease_ttl_ms=MOONCAKE_LEASE_TTL_MS)
            )
            configs[column] = master.client_config(MOONCAKE_SEGMENT_BYTES)
        yield StorageRun("mooncake", mooncake=configs)


def held_store_client_config(master: str) -> Dict[str, Any]:
    """A client of a store that outlives the run (``SimConfig.storage_mooncake_master``):
    no segment of its own, so the master places every object in the held segment."""
    return {
        "master_server_address": master,
        "protocol": "tcp",
        "metadata_server": "P2PHANDSHAKE",
        "local_hostname": "127.0.0.1",
        "global_segment_size": 0,
        "check_server": False,
    }


def _anchor_skips(cache: Any) -> int:
    """The plugin's count of ``cache``'s prefetches not issued under a pending backup (0
    for a cache without the plugin's extension)."""
    from sglang_cp_hicache.v0_5_23.cache.cache_extension import extension_of

    extension = extension_of(cache)
    return 0 if extension is None else extension.anchor_skips


def _page_hash_of(object_name: str) -> str:
    """The page hash an object file is named after (plugin: ``<hash>.<component>__<ns>``;
    upstream: ``<hash>_<suffix>``)."""
    return object_name.split(".", 1)[0].split("_", 1)[0]


@dataclass
class _Meter:
    """Pages this rank moved to and from L3 (written by upstream's storage threads)."""

    written_pages: int = 0
    read_pages: int = 0
    prior_read_pages: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)


class StorageTier:
    """One rank's L3 tier: attach, the scheduler's prefetch calls, settle, meters."""

    def __init__(
        self,
        stack: Any,
        run: StorageRun,
        column: str,
        group: Any,
        wrong_reads: bool = False,
    ) -> None:
        from sglang_cp_hicache.testing.v0_5_23 import storage

        self.stack, self.cache, self.run = stack, stack.cache, run
        self.group = group  # the CP group (None on one rank)
        host_pools = stack.host_pool_group.entry_map.values()  # KV anchor + DSA indexer
        bytes_per_token = sum(entry.host_pool.size_per_token for entry in host_pools)
        self.page_bytes = bytes_per_token * stack.config.page_size
        self.backend = storage.attach_storage(stack, run.backend, extra=run.extra_config(column))
        self.controller = stack.controller
        self.meter = _Meter()
        self.prior_hashes: Set[str] = set()
        if run.backend == "file":
            folder = run.folders[column]
            self.prior_hashes = {_page_hash_of(name) for name in os.listdir(folder)}
        self._spans: Dict[str, tuple] = {}  # rid -> (tokens, start) popped at admission
        self.prefetches_issued = 0
        self.requeries = 0  # prefetches re-issued after a prefix lost in the queue
        self._anchor_skips_at_start = _anchor_skips(self.cache)
        self._meter_page_functions(wrong_reads)

    # --------------------------------------------------------------- meters
    def _meter_page_functions(self, wrong_reads: bool) -> None:
        controller, meter = self.controller, self.meter
        page_set, page_get = controller.page_set_func, controller.page_get_func

        def metered_set(hash_values, host_indices, extra_info=None):
            ok = page_set(hash_values, host_indices, extra_info)
            if ok:
                with meter.lock:
                    meter.written_pages += len(hash_values)
            return ok

        def metered_get(operation, hash_values, host_indices, extra_info=None):
            read = page_get(operation, hash_values, host_indices, extra_info)
            prior = sum(1 for h in hash_values[:read] if h in self.prior_hashes)
            with meter.lock:
                meter.read_pages += read
                meter.prior_read_pages += prior
            if wrong_reads and read:
                self._corrupt_first_page(host_indices)
            return read

        controller.page_set_func, controller.page_get_func = metered_set, metered_get

    def _corrupt_first_page(self, host_indices: Any) -> None:
        """The ``storage_wrong_bytes`` fault: the first page a read returned lands in
        host memory with wrong bytes (as a backend returning a foreign object would)."""
        pool, row = self.controller.storage_host_pool, host_indices[0]
        page = pool.get_data_page(row, flat=True).clone()
        flat = page.reshape(-1).view(torch.uint8)
        flat[: min(64, flat.numel())] ^= 0x5A
        pool.set_from_flat_data_page(row, page)

    def stats(self) -> StorageRankStats:
        m = self.meter
        return StorageRankStats(
            backend=self.run.backend,
            backend_class=type(self.backend).__name__,
            written_pages=m.written_pages,
            read_pages=m.read_pages,
            prior_run_read_pages=m.prior_read_pages,
            page_bytes=self.page_bytes,
            rejected_reads=int(getattr(self.backend, "rejected_reads", 0) or 0),
            prefetches_issued=self.prefetches_issued,
            requeries=self.requeries,
            anchor_skips=_anchor_skips(self.cache) - self._anchor_skips_at_start,
        )

    # ------------------------------------------------------ scheduler calls
    def arrive(self, sreqs: Sequence[Any], op: Callable[[Optional[str]], Any]) -> None:
        """Each new request's L3 prefetch, as the scheduler issues it on arrival."""
        for sreq in sreqs:
            with op(None):
                self._prefetch(sreq.req)

    def _prefetch(self, req: Any) -> None:
        cache = self.cache
        req.init_next_round_input(cache, cow_mamba=False)
        anchor = req.last_host_node
        matched_len = req.prefix_len + req.host_hit_length
        req.storage_prefetch_last_match_len = matched_len
        if not (cache.is_backuped(anchor) or cache.is_root(anchor)):
            logger.debug("L3 prefetch %s: anchor not backed up, none issued", req.rid)
            return  # an unbacked anchor: a certain miss in cache mode
        fill_ids = req.full_untruncated_fill_ids
        match_end = req._compute_max_prefix_len(len(fill_ids))
        before = len(cache.ongoing_prefetch)
        cache.prefetch_from_storage(
            req.cache_request_handle,
            anchor,
            fill_ids[matched_len:match_end],
            cache.get_last_hash_value(anchor),
            None,  # hicache_storage_pass_prefix_keys is off
            matched_prefix_tokens=fill_ids[:matched_len],
            extra_key=req.extra_key,
            cache_salt=req.cache_salt,
        )
        self.prefetches_issued += int(len(cache.ongoing_prefetch) > before)
        logger.debug(
            "L3 prefetch %s: matched %d (device %d, host %d), anchor backed %s root %s, "
            "asked %d, issued %s", req.rid, matched_len, req.prefix_len, req.host_hit_length,
            cache.is_backuped(anchor), cache.is_root(anchor), match_end - matched_len,
            len(cache.ongoing_prefetch) > before,
        )  # fmt: skip

    def before_match(self, sreq: Any, op: Callable[[Optional[str]], Any]) -> None:
        """Admission: the prefetch must be done (settled), then its loaded span popped."""
        handle = sreq.req.cache_request_handle
        with op(None):
            done = self.cache.check_prefetch_progress(handle)
            loaded, start = self.cache.pop_prefetch_loaded_span(handle)
        if not done:
            raise RuntimeError(f"request {sreq.rid}: L3 prefetch still running after settle")
        if loaded > 0 and sreq.rid not in self._spans:
            self._spans[sreq.rid] = (int(loaded), int(start or 0))

    def after_match(self, sreq: Any, op: Callable[[Optional[str]], Any], match: Callable[[], None]) -> None:
        """A device or host prefix lost while the request waited (``Scheduler.
        _prefetch_after_device_hit_loss``, ``scheduler.py:3430-3458``): L3 is queried again
        for the exposed range; here the re-issued prefetch settles at once and the request
        is matched again (upstream admits it on a later round)."""
        req = sreq.req
        previous = req.storage_prefetch_last_match_len
        if not previous or req.prefix_len + req.host_hit_length >= previous:
            return
        self.requeries += 1
        with op(None):
            self._prefetch(req)
        self.settle()
        self.before_match(sreq, op)
        match()

    def hit_tokens(self, sreq: Any) -> int:
        """Tokens of the request's first chunk that came from L3 and were loaded to device
        (its popped span within the loaded host hit)."""
        tokens, start = self._spans.pop(sreq.rid, (0, 0))
        if tokens == 0:
            return 0
        begin = sreq.device_hit
        end = begin + sreq.req.host_loaded_length
        return max(0, min(start + tokens, end) - max(start, begin))

    # --------------------------------------------------------------- settle
    def settle(self) -> None:
        """Drain upstream's storage queues until no rank has L3 work in flight."""
        deadline = time.monotonic() + SETTLE_TIMEOUT_S
        while True:
            self.cache.drain_storage_control_queues()
            if not self._any_rank(self._busy()):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"rank {self.stack.shard_rank}: L3 I/O did not settle in {SETTLE_TIMEOUT_S} s "
                    f"({len(self.cache.ongoing_prefetch)} prefetches, "
                    f"{len(self.cache.ongoing_backup)} backups in flight)"
                )
            time.sleep(_POLL_S)

    def _busy(self) -> bool:
        cache, cc = self.cache, self.controller
        queues: List[Any] = [
            cc.prefetch_hit_queue, cc.ack_prefetch_queue, cc.ack_backup_queue,
            cc.host_mem_release_queue, *getattr(cc, "extra_host_mem_release_queues", {}).values(),
        ]  # fmt: skip
        return bool(cache.ongoing_prefetch or cache.ongoing_backup) or any(q.qsize() for q in queues)

    def _any_rank(self, flag: bool) -> bool:
        if self.group is None or dist.get_world_size(group=self.group) == 1:
            return flag
        value = torch.tensor([int(flag)], dtype=torch.int)
        dist.all_reduce(value, dist.ReduceOp.MAX, group=self.group)
        return bool(value.item())

    def close(self) -> None:
        from sglang_cp_hicache.testing.v0_5_23 import storage

        storage.detach_storage(self.stack)


__all__ = ["BACKENDS", "FOLDERS", "StorageRun", "StorageTier", "open_storage"]
