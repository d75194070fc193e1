"""The mechanism both lines use to put their hook tables into SGLang, without heavy imports.

A line's table (``v0_5_12.hooks.HOOKS``, ``v0_5_23.hooks.HOOKS``) names each target and each
hook callable by ``module:qualname``, so nothing is imported to describe it. :func:`install`
hands each spec to SGLang's ``HookRegistry`` (``sglang.srt.plugins``, the same framework in
both releases):

* target module already imported (``sglang.srt.server_args`` in the launcher): registered
  now, applied by ``load_plugins()`` right after the plugins run;
* otherwise: registered and applied by the process-wide post-import watcher right after
  the target module executes, before any other module can ``from target import X``.

A BEFORE/AFTER/AROUND hook is registered as a small trampoline that imports the real
callable on its first call, so neither registering nor applying imports this plugin's
cache, attention or model code (whose imports could reach back into an SGLang module still
being imported). A REPLACE hook must be the object itself (a class keeps ``isinstance``
working); it is imported when its target is applied.

SGLang only logs a hook that fails to apply, so :func:`missing_hooks` proves the chain holds
our hook for every spec and names each one that does not.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import pkgutil
import sys
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, Dict, Iterable, List, Optional, Set

from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_cp_hicache.core.import_watcher import installed_watcher, is_imported, process_watcher

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HookSpec:
    """One hook: ``target`` and ``hook`` are ``"module:qualname"`` paths.

    The colon makes the target's module explicit: the watcher must know which import to
    wait for, and a plain dotted path cannot tell module from attribute without importing.
    """

    target: str
    hook: str
    hook_type: str  # a sglang HookType member name

    @property
    def module(self) -> str:
        return self.target.split(":", 1)[0]

    @property
    def dotted_target(self) -> str:
        """The target as ``HookRegistry`` (and its log lines) spell it."""
        return self.target.replace(":", ".", 1)

    @property
    def qualname(self) -> str:
        return self.target.split(":", 1)[1]


class PluginNotInstalledError(RuntimeError):
    """A hook the plugin needs is not in place in this process."""


def resolve(path: str) -> Any:
    """The object a ``"module:qualname"`` path names (imports the module)."""
    return pkgutil.resolve_name(path)


# Per spec, what was handed to HookRegistry (trampoline or REPLACE object): the check
# looks for this very object in the installed wrapper chain.
_handed: Dict[HookSpec, Callable] = {}
_deferred: Set[HookSpec] = set()  # waiting for their target module's import
_errors: Dict[HookSpec, str] = {}  # why handing over failed
_lock = threading.RLock()


def _trampoline(spec: HookSpec) -> Callable:
    """A stand-in for ``spec.hook`` that imports the real callable on its first call."""
    resolved: List[Callable] = []

    def call_hook(*args, **kwargs):
        if not resolved:
            resolved.append(resolve(spec.hook))
        return resolved[0](*args, **kwargs)

    call_hook.__qualname__ = call_hook.__name__ = f"lazy[{spec.hook}]"
    return call_hook


def _hook_object(spec: HookSpec) -> Callable:
    with _lock:
        obj = _handed.get(spec)
        if obj is None:
            obj = resolve(spec.hook) if spec.hook_type == "REPLACE" else _trampoline(spec)
            _handed[spec] = obj
        return obj


def _register(spec: HookSpec, source: Any) -> None:
    """``HookRegistry.register`` once per spec: a second ``install`` (now or, through a
    second watcher callback, at import) finds the same hook object registered."""
    try:
        hook = _hook_object(spec)
        if any(h is hook for _, h, _ in HookRegistry._hooks.get(spec.dotted_target, ())):
            return
        HookRegistry.register(spec.dotted_target, hook, HookType[spec.hook_type], source=source)
    except Exception as exc:
        _errors[spec] = f"{type(exc).__name__}: {exc}"
        logger.exception("cp_hicache: cannot register the hook on %s", spec.dotted_target)


def _register_and_apply(spec: HookSpec, source: Any, _module: ModuleType) -> None:
    with _lock:
        _deferred.discard(spec)
    _register(spec, source)
    HookRegistry.apply_hooks()


def install(specs: Iterable[HookSpec], source: Any = None) -> None:
    """Register ``specs`` now (target imported) or right after their target's import.

    ``source`` is SGLang's ``HookSource`` for log lines. Imports no target module, and a
    spec that cannot be registered is logged and named by the check, never raised.
    """
    watcher = process_watcher()
    for spec in specs:
        if is_imported(spec.module):
            _register(spec, source)
            continue
        with _lock:
            _deferred.add(spec)

        def on_import(module: ModuleType, spec: HookSpec = spec) -> None:
            _register_and_apply(spec, source, module)

        watcher.when_imported(spec.module, on_import)


# ------------------------------------------------------------------------------- check
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


def _installed_attr(spec: HookSpec) -> Any:
    """The target's current attribute (raw ``__dict__`` entry for class attributes)."""
    *owner_path, attr = spec.qualname.split(".")
    owner: Any = sys.modules[spec.module]
    for part in owner_path:
        owner = getattr(owner, part)
    if isinstance(owner, type) and attr in owner.__dict__:
        return owner.__dict__[attr]
    return getattr(owner, attr)


def _waiting_for_import(spec: HookSpec) -> bool:
    watcher = installed_watcher()
    return spec in _deferred and watcher is not None and spec.module in watcher.pending()


def _why_missing(spec: HookSpec, import_targets: bool) -> Optional[str]:
    """None when ``spec``'s hook is in place (or waits for its target's import); else why."""
    if not is_imported(spec.module):
        if not import_targets:
            return None if _waiting_for_import(spec) else "not watching for its module's import"
        try:
            importlib.import_module(spec.module)
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
    if spec in _errors:
        return _errors[spec]
    hook = _handed.get(spec)
    if hook is None:
        return "never registered in this process"
    try:
        installed = _installed_attr(spec)
    except Exception as exc:  # renamed target
        return f"{type(exc).__name__}: {exc}"
    if not _hook_in_chain(installed, hook):
        return "not in the installed chain"
    if import_targets and spec.hook_type != "REPLACE":
        try:  # the trampoline's first call must not be where a broken import shows up
            resolve(spec.hook)
        except Exception as exc:
            return f"{spec.hook}: {type(exc).__name__}: {exc}"
    return None


def missing_hooks(specs: Iterable[HookSpec], *, import_targets: bool = True) -> List[str]:
    """``"target (why)"`` for each spec whose hook is not in place.

    ``import_targets=True`` imports every target module (running the watcher) and every
    hook callable. ``False`` imports nothing: a spec whose target module is not imported
    yet counts as in place while the watcher waits for that import.
    """
    missing = []
    for spec in specs:
        why = _why_missing(spec, import_targets)
        if why is not None:
            missing.append(f"{spec.dotted_target} ({why})")
    return missing


def raise_if_missing(missing: List[str], release: str) -> None:
    """Raise :class:`PluginNotInstalledError` naming every entry of ``missing`` (a line's
    ``missing_hooks()``); ``release`` is the SGLang release that line targets."""
    if missing:
        raise PluginNotInstalledError(
            "--enable-nsa-prefill-cp-shared-kv: the sglang-cp-hicache plugin is not fully "
            "installed in this process; these hooks are missing: "
            + ", ".join(missing)
            + f". Check that the package is pip-installed next to sglang=={release}, that "
            "SGLANG_PLUGINS (if set) includes 'cp_hicache', and the log lines "
            "'Failed to apply hooks to ...' above."
        )


def verified_flag_action(verify: Callable[..., None]) -> type:
    """An argparse ``store_true`` action that first runs ``verify(import_targets=False)``.

    Parsing the plugin's flag thereby proves every hook whose target is already imported is
    in place, importing nothing: hooks on modules not imported yet must be waiting for them
    (the full check runs where the line's pools are built).
    """

    class VerifiedFlagAction(argparse.Action):
        def __init__(self, option_strings, dest, **kwargs):
            super().__init__(option_strings, dest, nargs=0, default=False, **kwargs)

        def __call__(self, parser, namespace, values, option_string=None):
            verify(import_targets=False)
            setattr(namespace, self.dest, True)

    return VerifiedFlagAction
