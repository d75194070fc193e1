"""``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23: its names, its error, and the flag
stored on a record before resolution.

Meaning: the flag is upstream's ``--enable-kv-cache-sharding`` (each prefill-CP rank stores
only the KV pages it owns, owner = logical page % cp_size) plus the plugin's deltas. Every
upstream sharding rule applies unchanged: a resolution step declares
``enable_kv_cache_sharding=True`` before upstream's gate (``handle_kv_cache_sharding``) runs
(``resolution.py``). On one prefill rank with L3 storage (``--tp 1
--hicache-storage-backend file|mooncake``: CP size 1, nothing to shard, and upstream refuses
DSA sharding there) the flag means an unsharded stack whose L3 backend uses the plugin's
owner-free keys, so it reads a sharded fleet's pages (``docs/l3_storage.md``). Which of the
two a server runs is its :class:`~sglang_cp_hicache.v0_5_23.launch.cp_mode.CpMode`, decided
once at resolution and read by startup code from the record (``cp_mode.cp_mode``).

How the flag travels, given that 0.5.23's ``ServerArgs`` is a sealed msgspec struct whose
Python ``__init__`` never runs: the command line (``cli.py``), ``Engine(**kwargs)``
(``engine.py``), and on the record the mode (:func:`set_cp_shared_kv_enabled`), which
``__reduce__`` carries to spawned schedulers.
"""

from __future__ import annotations

from typing import Any

from sglang_cp_hicache import plugin
from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode, store_mode

FLAG = "enable_nsa_prefill_cp_shared_kv"  # argparse dest and Engine keyword
CLI_FLAG = "--enable-nsa-prefill-cp-shared-kv"
# The source our declarations carry in the record's resolution stash.
DECLARATION_SOURCE = "sglang_cp_hicache.enable_nsa_prefill_cp_shared_kv"


class CpSharedKVConfigError(ValueError):
    """An unsupported server configuration together with CP shared KV."""


def set_cp_shared_kv_enabled(server_args: Any, enabled: bool) -> None:
    """Store the flag on a record before it is resolved: the mode it asks for,
    :attr:`CpMode.SHARDED` (resolution settles it, ``resolution.decide_mode``), or off."""
    if (cp_mode(server_args) is not CpMode.OFF) == bool(enabled):
        return  # as asked already (a mode resolution settled stays)
    if getattr(server_args, "_resolution_finished", False):
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: this ServerArgs is already resolved, so the flag can no longer "
            "change; pass it when the record is built (command line or Engine keyword)"
        )
    store_mode(server_args, CpMode.SHARDED if enabled else CpMode.OFF)


def verify_plugin_installed(*, import_targets: bool = False) -> None:
    """Where the flag turns on: every hook and resolution step of the installed line in
    place (by default importing nothing: hooks whose target is not imported yet must be
    waiting for it). The line's own check, reached through the plugin's entry point as
    registration reaches the line: no room imports the line's hook table."""
    plugin.verify_installed(import_targets=import_targets)


__all__ = [
    "CLI_FLAG",
    "CpSharedKVConfigError",
    "DECLARATION_SOURCE",
    "FLAG",
    "set_cp_shared_kv_enabled",
    "verify_plugin_installed",
]
