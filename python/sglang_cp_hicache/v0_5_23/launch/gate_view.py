"""L3 storage at upstream's sharding gate under ``--enable-nsa-prefill-cp-shared-kv``.

Upstream's gate (``kv_shard_hook.handle_kv_cache_sharding``) refuses every
``--hicache-storage-backend`` under sharding; the plugin's file and mooncake backends lift
that (owner-free keys, owner writes and reads: ``docs/l3_storage.md``). The gate reads the
record through the module-global ``resolving_view``; within :func:`storage_hidden_from_gate`
the gate module's own binding of that name shows a record that has the flag without an
admitted L3 backend, and every other rule of the gate reads the record as it is.
"""

from __future__ import annotations

from typing import Any, Callable, ContextManager, Optional

from sglang_cp_hicache.core.field_overlay import FieldOverlay
from sglang_cp_hicache.core.module_binding import binding_swapped
from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode
from sglang_cp_hicache.v0_5_23.launch.refusals import SUPPORTED_STORAGE_BACKENDS


def _storage_hidden(backend: Optional[str]) -> Optional[str]:
    """An admitted backend (file, mooncake) hidden from upstream's gate, so its storage rule
    passes; any other shows through (the plugin's own refusal,
    ``refusals.unsupported_combinations``, has named it already; if a later step declared
    one, upstream's verdict stands)."""
    return None if backend in SUPPORTED_STORAGE_BACKENDS else backend


def storage_hidden_from_gate() -> ContextManager[None]:
    """Within: upstream's gate module (``sglang.srt.arg_groups.kv_shard_hook``) reads a
    record that has the flag without an admitted L3 backend (a ``FieldOverlay`` showing
    :func:`_storage_hidden`); any other record, and any other module, through upstream's
    own ``resolving_view``."""
    from sglang.srt.arg_groups import kv_shard_hook as gate

    def without_storage(upstream_view: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def view(server_args: Any) -> Any:
            cfg = upstream_view(server_args)
            if not cp_mode(server_args).shards_kv:
                return cfg
            return FieldOverlay(cfg, {"hicache_storage_backend": _storage_hidden})

        return view

    # No seam but the name: the gate takes no view, and a hook on resolving_view would
    # change every resolution step's reads; so only the gate module's binding, for the gate.
    return binding_swapped(gate, "resolving_view", without_storage)


__all__ = ["storage_hidden_from_gate"]
