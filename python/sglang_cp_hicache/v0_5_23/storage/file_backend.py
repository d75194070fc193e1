"""The file L3 backend under CP shared KV: owner-free namespaced keys, exact-size reads.

:class:`OwnerFreeHiCacheFile` subclasses SGLang 0.5.23's ``HiCacheFile`` and changes only
what a key is and what a read accepts:

* keys are :meth:`core.storage_keys.StorageNamespace.object_key` (page hash, component,
  namespace id), never upstream's ``_cp{rank}_{size}`` suffix (``hicache_storage.py:
  751-754``), which would make a page's object depend on its writer;
* a read hits only when the file holds exactly one page of the host pool's format: a
  torn, short or oversized file (a bf16 page read as fp8 would fill the smaller buffer
  without error) is a miss, logged and counted, never an exception in the prefetch thread.

Writes stay upstream's (temp file + ``os.replace``, ``hicache_storage.py:899-922``).
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, ClassVar, Optional

import torch
from sglang.srt.disaggregation.kv_events import StorageMedium
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig

from sglang_cp_hicache.core.storage_keys import StorageNamespace, component_of_pool
from sglang_cp_hicache.v0_5_23.cache.plugin_metrics import L3Health

logger = logging.getLogger(__name__)


def storage_namespace(host_pool: Any, model_name: Optional[str]) -> StorageNamespace:
    """The namespace of ``host_pool``'s pages (the KV anchor; a sharded pool forwards its
    format to the native pool it wraps, so one prefill rank's unsharded pool of the same
    format has the same namespace). ``model_name``: the storage config's."""
    start_layer = getattr(host_pool, "start_layer", 0)
    return StorageNamespace(
        model=model_name or "unnamed-model",
        kv_dtype=str(host_pool.dtype),
        kv_cache_dim=int(host_pool.kv_cache_dim),
        layer_num=int(host_pool.layer_num),
        host_layout=str(host_pool.layout),
        page_size=int(host_pool.page_size),
        extra=f"start_layer={start_layer}" if start_layer else "",
    )


class OwnerFreeHiCacheFile(HiCacheFile):
    """``HiCacheFile`` keyed by :class:`StorageNamespace`; see the module docstring.

    Invariant: every object this backend writes or reads is named
    ``<page hash>.<component>__<namespace id>``, whatever rank or cp size wrote it.
    """

    #: The KV events' medium of this tier (``storage/l3_events.py``).
    EVENT_MEDIUM: ClassVar[str] = StorageMedium.DISK

    def __init__(self, storage_config: HiCacheStorageConfig, namespace: StorageNamespace):
        self.namespace = namespace
        self._rejected_reads = 0
        self._count_lock = threading.Lock()
        super().__init__(storage_config)
        # The evictor and the metadata scan select this backend's files by suffix.
        self.config_suffix = self.tp_config_suffix = namespace.key_suffix
        if not os.path.isdir(self.file_path):
            os.makedirs(self.file_path, exist_ok=True)  # every rank may be first

    @property
    def rejected_reads(self) -> int:
        """Reads refused for a file of the wrong size (torn, short or foreign)."""
        return self._rejected_reads

    def l3_health(self) -> L3Health:
        """This backend's counts for the plugin's metrics (``cache/plugin_metrics.py``)."""
        return L3Health(rejected_reads=self._rejected_reads)

    def _get_suffixed_key(self, key: str) -> str:
        # Upstream names a sidecar's object "<hash>.<pool>" (_log_key) before suffixing.
        page_hash, _, pool = key.partition(".")
        return self.namespace.object_key(component_of_pool(pool or None), page_hash)

    def get(
        self, key: str, target_location: torch.Tensor, target_sizes: Optional[Any] = None
    ) -> Optional[torch.Tensor]:
        path = os.path.join(self.file_path, f"{self._get_suffixed_key(key)}.bin")
        expected = target_location.numel() * target_location.element_size()
        try:
            size = os.path.getsize(path)
        except FileNotFoundError:
            return None
        if size != expected:
            self._reject(key, f"holds {size} bytes, a page is {expected}")
            return None
        try:
            return super().get(key, target_location, target_sizes)
        except (IOError, OSError) as exc:  # deleted or truncated after the size check
            self._reject(key, str(exc))
            return None

    def _reject(self, key: str, why: str) -> None:
        with self._count_lock:
            self._rejected_reads += 1
        logger.warning("cp_hicache L3 file: page %s is a miss: %s", key, why)


__all__ = ["OwnerFreeHiCacheFile", "storage_namespace"]
