"""``Engine(enable_nsa_prefill_cp_shared_kv=True, ...)`` on SGLang 0.5.23.

``Engine.__init__`` (AROUND) takes the keyword off before Engine builds its record: 0.5.23's
``ServerArgs`` is a sealed msgspec struct whose Python ``__init__`` never runs, so the keyword
is no record field. Only once plugins are loaded in the process: the first ``Engine(...)`` of
a fresh process enters the unhooked ``__init__``, whose own ``load_plugins()`` comes too late
for that call, and msgspec rejects the keyword ("Unexpected keyword argument"). Call
``sglang.srt.plugins.load_plugins()`` before the first Engine, or pass
``server_args=prepare_server_args([..., "--enable-nsa-prefill-cp-shared-kv"])``.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.v0_5_23.launch.flag import (
    FLAG,
    set_cp_shared_kv_enabled,
    verify_plugin_installed,
)
from sglang_cp_hicache.v0_5_23.launch.legacy_spellings import translate_legacy_spellings


def engine_init_around(original: Callable, engine: Any, **kwargs) -> None:
    """The keyword is taken off here and stored on the record Engine builds."""
    enabled = bool(kwargs.pop(FLAG, False))
    if "server_args" in kwargs:  # Engine ignores every other keyword then
        if enabled:
            set_cp_shared_kv_enabled(kwargs["server_args"], True)
        return original(engine, **kwargs)
    translate_legacy_spellings(kwargs, cp_shared_kv=enabled)
    if not enabled:
        return original(engine, **kwargs)
    verify_plugin_installed()
    build_record = engine.server_args_class

    def build_enabled_record(**fields: Any) -> Any:
        record = build_record(**fields)
        set_cp_shared_kv_enabled(record, True)
        return record

    # Engine.__init__ builds its record as self.server_args_class(**kwargs): shadowing the
    # class attribute on this instance marks that record before anything resolves it,
    # and leaves the rest of upstream's construction (log level, launch command) as is.
    engine.server_args_class = build_enabled_record
    try:
        return original(engine, **kwargs)
    finally:
        del engine.server_args_class


__all__ = ["engine_init_around"]
