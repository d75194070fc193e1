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
"""

from __future__ import annotations

from typing import List

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

from sglang_cp_hicache.core.storage_keys import StorageNamespace


class OwnerFreeMooncakeStore(MooncakeStore):
    """Invariant: every key this store touches starts with ``<namespace id>_``."""

    def __init__(self, storage_config: HiCacheStorageConfig, namespace: StorageNamespace):
        self.namespace = namespace
        super().__init__(storage_config)

    def _tag_keys(self, keys: List[str]) -> List[str]:
        prefix = self.namespace.namespace_id
        return [f"{prefix}_{key}" for key in super()._tag_keys(keys)]


__all__ = ["OwnerFreeMooncakeStore"]
