"""Entry point (group ``sglang.srt.plugins``): registers the plugin's hooks, nothing else.

SGLang calls :func:`register` with no arguments in the launcher, ``Engine`` and every
scheduler process, then applies the hooks. Every hook decides at call time, from the server
args it receives, whether CP shared KV is on; with the flag off each one defers to upstream.

SGLang only *logs* a hook that fails to apply, so :func:`verify_hooks_installed` runs
whenever the flag is turned on (option parsing, ``Engine(**kw)``, pool initialisation) and
stops startup if any hook is missing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Tuple

from sglang_cp_hicache import server_args as _server_args
from sglang_cp_hicache.disaggregation import utils as _disagg_utils
from sglang_cp_hicache.disaggregation.mooncake import conn as _mooncake_conn
from sglang_cp_hicache.layers.attention import nsa_backend_hooks as _nsa_hooks
from sglang_cp_hicache.mem_cache.hiradix_cache import CpHiRadixCache
from sglang_cp_hicache.model_executor import model_runner_kv_cache_mixin as _kv_mixin


@dataclass(frozen=True)
class HookSpec:
    target: str
    hook: Callable
    hook_type: str  # a sglang HookType member name


_SERVER_ARGS = "sglang.srt.server_args.ServerArgs"

HOOKS: Tuple[HookSpec, ...] = (
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", _server_args.add_cli_args_after, "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", _server_args.from_cli_args_around, "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__init__", _server_args.init_around, "AROUND"),
    HookSpec(f"{_SERVER_ARGS}.__post_init__", _server_args.post_init_after, "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.check_server_args", _server_args.check_server_args_after, "AFTER"),
    HookSpec(
        "sglang.srt.model_executor.model_runner_kv_cache_mixin.ModelRunnerKVCacheMixin._init_pools",
        _kv_mixin.init_pools_around,
        "AROUND",
    ),
    # Safe to replace: the scheduler imports HiRadixCache lazily, after hooks apply, and
    # the subclass is upstream HiRadixCache unless the allocator is the CP one.
    HookSpec("sglang.srt.mem_cache.hiradix_cache.HiRadixCache", CpHiRadixCache, "REPLACE"),
    # Shared-KV attention runtime: write translation, prefix materialisation, PD filter.
    *(
        HookSpec(target, hook, hook_type)
        for target, hook, hook_type in (
            _nsa_hooks.HOOK_SPECS + _disagg_utils.HOOK_SPECS + _mooncake_conn.HOOK_SPECS
        )
    ),
)


class PluginNotInstalledError(RuntimeError):
    """A hook the plugin needs is not in place in this process."""


def register() -> None:
    """Register every hook with SGLang's ``HookRegistry`` (applied by ``load_plugins``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for spec in HOOKS:
        HookRegistry.register(spec.target, spec.hook, HookType[spec.hook_type])


def _hook_in_chain(obj: object, hook: Callable) -> bool:
    """Walk SGLang's wrapper chain (``__wrapped__``) looking for ``hook`` in a closure."""
    if isinstance(hook, type):
        return isinstance(obj, type) and issubclass(obj, hook)
    seen = 0
    while obj is not None and seen < 64:
        func = getattr(obj, "__func__", obj)
        for cell in getattr(func, "__closure__", None) or ():
            try:
                if cell.cell_contents is hook:
                    return True
            except ValueError:  # empty cell
                continue
        obj = getattr(func, "__wrapped__", None)
        seen += 1
    return False


def missing_hooks(specs: Optional[Iterable[HookSpec]] = None) -> list[str]:
    """Targets (default: all of :data:`HOOKS`) whose installed attribute lacks our hook."""
    import pkgutil

    missing = []
    for spec in HOOKS if specs is None else specs:
        owner_path, attr = spec.target.rsplit(".", 1)
        try:
            owner = pkgutil.resolve_name(owner_path)
            installed = (
                owner.__dict__.get(attr, getattr(owner, attr))
                if isinstance(owner, type)
                else getattr(owner, attr)
            )
        except Exception as exc:  # import error or renamed target
            missing.append(f"{spec.target} ({type(exc).__name__}: {exc})")
            continue
        if not _hook_in_chain(installed, spec.hook):
            missing.append(spec.target)
    return missing


def verify_hooks_installed() -> None:
    missing = missing_hooks()
    if missing:
        raise PluginNotInstalledError(
            "--enable-nsa-prefill-cp-shared-kv: the sglang-cp-hicache plugin is not fully "
            "installed in this process; these hooks are missing: "
            + ", ".join(missing)
            + ". Check that the package is pip-installed next to sglang==0.5.12.post1, that "
            "SGLANG_PLUGINS (if set) includes 'cp_hicache', and the log lines "
            "'Failed to apply hooks to ...' above."
        )
