"""Entry point (group ``sglang.srt.plugins``): hands the installed release's hooks to SGLang.

SGLang calls :func:`register` with no arguments in the launcher, ``Engine`` and every
scheduler process, then applies the hooks. :func:`register` picks the line of the installed
SGLang release (:mod:`sglang_cp_hicache.core.releases`) and refuses any other release with
one message naming the supported ones. Registration imports no SGLang cache, model or kernel
module, so the flag and its validation work in any process that can import
``sglang.srt.server_args``. Every hook decides at call time, from the server args it
receives, whether CP shared KV is on; with the flag off each one defers to upstream.
"""

from __future__ import annotations

import importlib
from types import ModuleType

from sglang_cp_hicache.core.releases import line_package


def line_hooks() -> ModuleType:
    """The hook-table module of the installed release's line (raises for any other release)."""
    return importlib.import_module(f"{line_package()}.hooks")


def register() -> None:
    """Hand every hook of the installed line's table to SGLang's ``HookRegistry``."""
    from sglang.srt.plugins.hook_registry import _current_plugin_source

    hooks = line_hooks()
    # Deferred hooks register after load_plugins() has reset the source: keep it now.
    hooks.register(source=_current_plugin_source.get())


def verify_installed(*, import_targets: bool = True) -> None:
    """The installed line's check (its ``verify_hooks_installed``): raises
    ``PluginNotInstalledError`` naming every hook (and resolution step) not in place. A
    line's own modules reach their line's hook table this way, as registration does,
    never by importing it."""
    line_hooks().verify_hooks_installed(import_targets=import_targets)
