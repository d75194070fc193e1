"""The plugin's mode on SGLang 0.5.23: one frozen value per server record.

:class:`CpMode` is what ``--enable-nsa-prefill-cp-shared-kv`` means for one server: off,
sharded KV (upstream's ``--enable-kv-cache-sharding`` plus the plugin's deltas), or one
prefill rank that only reads and writes a sharded fleet's L3 pages (owner-free keys,
``docs/l3_storage.md``). It lives on the record as the underscore attribute
:data:`MODE_ATTR`: SGLang 0.5.23's record is the only object that travels from the launcher
to every spawned scheduler (its ``__reduce__`` carries underscore attributes) and has no
field for a plugin, so the mode rides there, written by :func:`store_mode` and read by
:func:`cp_mode`, the one writer and the one reader. The flag stores
:attr:`CpMode.SHARDED` (``flag.set_cp_shared_kv_enabled``), and the resolution step's one
decision (``resolution.decide_mode``) settles it, narrowing it to
:attr:`CpMode.ONE_RANK_L3_READER` on one prefill rank; after resolution it never changes.

Code that runs per call never reads it: a sharded cache's hooks ask whether the cache has a
``CpCacheExtension`` (built once, in this mode). Startup code reads the value once with
:func:`cp_mode` and asks its properties.
"""

from __future__ import annotations

import enum
from typing import Any

#: The record's attribute holding its :class:`CpMode` (absent: off).
MODE_ATTR = "_cp_hicache_mode"


class CpMode(enum.Enum):
    """What the plugin does for one server (frozen once resolution has run)."""

    OFF = "off"
    SHARDED = "sharded"
    ONE_RANK_L3_READER = "one_rank_l3_reader"

    @property
    def shards_kv(self) -> bool:
        """KV sharded over the prefill CP group: every sharding delta applies (self-test,
        lane eviction, per-layer backup, the DSA backend rule, L3 owner rules)."""
        return self is CpMode.SHARDED

    @property
    def owner_free_storage(self) -> bool:
        """The L3 file / mooncake backends use the owner-free keys (sharded, or one prefill
        rank reading a sharded fleet's pages)."""
        return self is not CpMode.OFF


def cp_mode(server_args: Any) -> CpMode:
    """The mode stored on ``server_args`` (a record, or a resolution view of one).

    Only a :class:`CpMode` stored by ``server_args`` counts, so an object that merely
    answers every attribute (a mock, a foreign config) reads as off."""
    mode = getattr(server_args, MODE_ATTR, CpMode.OFF)
    return mode if isinstance(mode, CpMode) else CpMode.OFF


def store_mode(server_args: Any, mode: CpMode) -> None:
    """Store ``mode`` on the record ``server_args`` (the sealed record takes an underscore
    attribute before, during and after resolution)."""
    setattr(server_args, MODE_ATTR, mode)


__all__ = ["CpMode", "MODE_ATTR", "cp_mode", "store_mode"]
