"""Entry point (group ``sglang.srt.plugins``): hands the plugin's hooks to SGLang, nothing else.

SGLang calls :func:`register` with no arguments in the launcher, ``Engine`` and every
scheduler process, then applies the hooks. Registration imports no SGLang cache, model or
kernel module (see :mod:`sglang_cp_hicache.hooks`), so the flag and its validation work in
any process that can import ``sglang.srt.server_args``. Every hook decides at call time,
from the server args it receives, whether CP shared KV is on; with the flag off each one
defers to upstream.
"""

from __future__ import annotations

from sglang_cp_hicache import hooks


def register() -> None:
    """Hand every hook of :data:`~sglang_cp_hicache.hooks.HOOKS` to SGLang's ``HookRegistry``."""
    from sglang.srt.plugins.hook_registry import _current_plugin_source

    # Deferred hooks register after load_plugins() has reset the source: keep it now.
    hooks.install(hooks.HOOKS, source=_current_plugin_source.get())
