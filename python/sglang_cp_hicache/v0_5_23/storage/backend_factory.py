"""Which L3 backend HiCache gets under ``--enable-nsa-prefill-cp-shared-kv``.

AROUND ``StorageBackendFactory.create_backend``: when the plugin's flag is on, sharded
(upstream's ``PageInterleaveHostPool``) or on one prefill rank (an unsharded host pool,
reading a sharded fleet's pages), ``file`` becomes
:class:`~sglang_cp_hicache.v0_5_23.storage.file_backend.OwnerFreeHiCacheFile` and
``mooncake`` becomes
:class:`~sglang_cp_hicache.v0_5_23.storage.mooncake_backend.OwnerFreeMooncakeStore`
(owner-free namespaced keys); any other backend is refused with one message. Flag off:
upstream's factory, unchanged (the builtin registry is never rewritten, so other processes
and flag-off servers see upstream's classes). The owner write / read rules apply only to a
sharded pool (a cache with a ``CpCacheExtension``, ``cache_extension.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Tuple

from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

logger = logging.getLogger(__name__)

#: The backends a CPU twin proves under CP shared KV.
OWNER_FREE_BACKENDS: Tuple[str, ...] = ("file", "mooncake")


class UnsupportedShardedStorageError(ValueError):
    """An L3 backend the plugin has not proven under CP shared KV."""


def refuse_unless_owner_free(backend_name: str) -> None:
    if backend_name not in OWNER_FREE_BACKENDS:
        raise UnsupportedShardedStorageError(
            f"{CLI_FLAG}: --hicache-storage-backend {backend_name} is not supported with CP "
            f"shared KV (supported: {', '.join(OWNER_FREE_BACKENDS)}); its keys and reads "
            "are not proven for pages each rank stores only where it owns them"
        )


def create_backend_around(
    original: Callable,
    factory: type,
    backend_name: str,
    storage_config: Any,
    mem_pool_host: Any,
    **kwargs: Any,
) -> Any:
    from sglang.srt.runtime_context import get_server_args

    if not cp_mode(get_server_args()).owner_free_storage:  # once per backend built
        return original(factory, backend_name, storage_config, mem_pool_host, **kwargs)
    refuse_unless_owner_free(backend_name)
    from sglang.srt.mem_cache.hicache_storage import (
        _maybe_wrap_hicache_storage_failure_injector,
    )

    from sglang_cp_hicache.v0_5_23.storage.file_backend import (
        OwnerFreeHiCacheFile,
        storage_namespace,
    )

    namespace = storage_namespace(mem_pool_host, storage_config.model_name)
    if backend_name == "file":
        backend = OwnerFreeHiCacheFile(storage_config, namespace)
    else:
        from sglang_cp_hicache.v0_5_23.storage.mooncake_backend import (
            OwnerFreeMooncakeStore,
        )

        backend = OwnerFreeMooncakeStore(storage_config, namespace)
    logger.info(
        "cp_hicache: L3 %s backend with owner-free keys (namespace %s)",
        backend_name,
        namespace.namespace_id,
    )
    # Upstream's fault-injection wrapper stays available, as for its own backends.
    return _maybe_wrap_hicache_storage_failure_injector(backend)


__all__ = [
    "OWNER_FREE_BACKENDS",
    "UnsupportedShardedStorageError",
    "create_backend_around",
    "refuse_unless_owner_free",
]
