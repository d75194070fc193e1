"""Runtime attach of the L3 backend under ``--enable-nsa-prefill-cp-shared-kv`` (issue 24).

AROUND upstream's ``StorageAttachment.attach``, the admin API's path
(``/attach_hicache_storage_backend`` -> ``Scheduler.attach_hicache_storage_wrapped``, only
when the scheduler is idle -> ``UnifiedRadixCache.attach_storage_backend``):

* flag off: upstream's attach, unchanged; under ``--enable-kv-cache-sharding`` it refuses
  every backend (``storage_attachment.py:78-84``, "Runtime attach bypasses
  kv_shard_hook.py's startup validation");
* flag on, a backend the launch would refuse (anything but file and mooncake):
  ``(False, message)`` before anything changes, the message being the startup refusal of
  this server launched with that backend (:func:`startup_refusal`);
* flag on, mooncake on host pools that are not page-first: refused the same way
  (:func:`layout_refusal`). A launch with mooncake resolves to page_first (upstream's
  layer_first -> page_first rewrite), but host pools cannot change at runtime, and on a
  layer_first DSA pool upstream's attach succeeds while every backup then fails in the
  backup thread (``pool_host/dsa.py:get_page_buffer_meta``, "Unsupported layout") and
  every prefetch misses;
* flag on, file or mooncake: upstream's attach, with its sharding check answered for this
  cache's allocator as the startup gate is for these backends
  (``launch/gate_view.py``). Everything else is upstream's and the
  plugin's startup path: policies, the storage config (the writer rule,
  ``generate_storage_config_around``), the backend from ``StorageBackendFactory`` (the
  owner-free backends, ``create_backend_around``), threads and sync groups, the runtime
  config (hashes of the nodes that predate storage). The owner writes / reads, the start
  owner and the host room are the hooks of the cache's extension (built with the cache,
  its host side with HiCache; ``cache_extension.py``), so they hold after an attach as
  after a startup with storage.

Detach is upstream's (it has no sharding check); a re-attach builds a fresh backend.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional, Tuple

from sglang_cp_hicache.core.field_overlay import FieldOverlay, constant
from sglang_cp_hicache.core.module_binding import binding_swapped
from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG
from sglang_cp_hicache.v0_5_23.launch.refusals import unsupported_combinations


def startup_refusal(server_args: Any, backend: Optional[str]) -> Optional[str]:
    """The refusal a launch of ``server_args``' server with ``--hicache-storage-backend
    backend`` meets (``refusals.unsupported_combinations``, one message starting with
    the flag), or None when it would start. The record has passed resolution, so only the
    backend can be refused here."""
    problems = unsupported_combinations(
        # the running server's record as launched with --hicache-storage-backend backend
        FieldOverlay(server_args, {"hicache_storage_backend": constant(backend)})
    )
    return f"{CLI_FLAG}: " + "; ".join(problems) if problems else None


#: The host layout a launch with Mooncake resolves to under the flag: the sharding gate
#: requires kernel I/O, for which upstream rewrites layer_first to page_first
#: (``arg_groups/hicache_hook.py:resolve_storage_layout_compatibility``); the DSA host
#: pools' zero-copy page meta takes page-first layouts only.
MOONCAKE_HOST_LAYOUT = "page_first"


def layout_refusal(backend: Optional[str], host_layout: str) -> Optional[str]:
    """Why ``backend`` cannot be attached to host pools of ``host_layout`` (None: it can)."""
    if backend != "mooncake" or host_layout == MOONCAKE_HOST_LAYOUT:
        return None
    return (
        f"{CLI_FLAG}: --hicache-storage-backend mooncake needs the {MOONCAKE_HOST_LAYOUT} "
        f"host layout, which a launch with it resolves to; this server's host pools are "
        f"{host_layout} and cannot change while it runs: restart with "
        f"--hicache-mem-layout {MOONCAKE_HOST_LAYOUT}, or attach file"
    )


def sharding_check_answered(allocator: Any) -> ContextManager[None]:
    """Within: upstream's attach module reads ``allocator`` (this cache's) as unsharded at
    its sharding check; any other allocator, and every other module, keep upstream's
    ``page_interleave_shard_size``. Only the attach module's binding of the name is
    swapped, for one attach on the scheduler thread (:func:`binding_swapped`)."""
    from sglang.srt.mem_cache.unified_cache import storage_attachment as upstream

    def answered(upstream_shard_size: Callable[[Any], int]) -> Callable[[Any], int]:
        return lambda candidate: 1 if candidate is allocator else upstream_shard_size(candidate)

    # No seam but the name: attach takes no allocator or check, and a hook on
    # page_interleave_shard_size would run on every allocation; so only this module's binding.
    return binding_swapped(upstream, "page_interleave_shard_size", answered)


def attach_around(
    original: Callable, attachment: Any, storage_backend: str, *args: Any, **kwargs: Any
) -> Tuple[bool, str]:
    """Upstream's attach; under the flag, refused before anything changes when a launch
    would refuse it, else run with the sharding check answered (module docstring)."""
    from sglang.srt.runtime_context import get_server_args

    server_args = get_server_args()
    if not cp_mode(server_args).owner_free_storage:  # once per admin attach
        return original(attachment, storage_backend, *args, **kwargs)
    cache = attachment._cache  # the attachment's one cache (upstream keeps it private)
    refusal = startup_refusal(server_args, storage_backend)
    if refusal is None and cache.cache_controller is not None:  # None: upstream refuses
        refusal = layout_refusal(storage_backend, cache.cache_controller.storage_host_pool.layout)
    if refusal is not None:
        return False, refusal
    with sharding_check_answered(cache.token_to_kv_pool_allocator):
        return original(attachment, storage_backend, *args, **kwargs)


__all__ = [
    "MOONCAKE_HOST_LAYOUT",
    "attach_around",
    "layout_refusal",
    "sharding_check_answered",
    "startup_refusal",
]
