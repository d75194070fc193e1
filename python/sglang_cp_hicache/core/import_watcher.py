"""Run callbacks right after a named module finishes executing (a post-import hook).

A :class:`PostImportWatcher` sits first in ``sys.meta_path``. For a watched module name it
asks the finders behind it for the real spec and wraps the spec's loader, so that right
after the module body executes, and before the importing statement (``import x`` or
``from x import y``) gets the module back, the watched callbacks run. Invariants:

* a callback runs at most once, with the fully executed module;
* a module that is already imported is never watched: :meth:`when_imported` runs the
  callback at once instead;
* a failed import runs no callback and keeps it pending for the next attempt;
* a callback that raises is logged, never breaks the import that triggered it;
* the imported module keeps its real loader (``__loader__``, ``__spec__.loader``).

Generic: knows nothing of SGLang or of hooks.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from types import ModuleType
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

Callback = Callable[[ModuleType], None]


def is_imported(name: str) -> bool:
    """True when ``name`` is in ``sys.modules`` and its body has finished executing."""
    module = sys.modules.get(name)
    if module is None:
        return False
    return not getattr(getattr(module, "__spec__", None), "_initializing", False)


class _NotifyingLoader(importlib.abc.Loader):
    """Delegates to the real loader; tells the watcher once the module body has run."""

    def __init__(self, loader: importlib.abc.Loader, watcher: "PostImportWatcher") -> None:
        self._loader = loader
        self._watcher = watcher

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Optional[ModuleType]:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        # Put the real loader back first: the module should look as if never watched.
        module.__loader__ = self._loader
        if module.__spec__ is not None:
            module.__spec__.loader = self._loader
        self._loader.exec_module(module)
        self._watcher._module_executed(module)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)


class PostImportWatcher(importlib.abc.MetaPathFinder):
    """A ``sys.meta_path`` finder that runs callbacks after watched modules execute."""

    def __init__(self) -> None:
        self._pending: Dict[str, List[Callback]] = {}
        self._lock = threading.RLock()

    def when_imported(self, name: str, callback: Callback) -> bool:
        """Run ``callback(module)`` now if ``name`` is imported, else right after its import.

        Returns True when the callback ran now.
        """
        if is_imported(name):
            self._run(name, sys.modules[name], [callback])
            return True
        with self._lock:
            self._pending.setdefault(name, []).append(callback)
        return False

    def pending(self) -> Sequence[str]:
        """Module names with callbacks still waiting for their import."""
        with self._lock:
            return tuple(self._pending)

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self._pending:
            return None
        spec = self._spec_from_later_finders(fullname, path, target)
        # Loaders without exec_module (legacy load_module) and namespace packages are
        # left alone; their callbacks stay pending.
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        spec.loader = _NotifyingLoader(spec.loader, self)
        return spec

    def _spec_from_later_finders(self, fullname, path, target):
        finders = list(sys.meta_path)
        start = next((i for i, f in enumerate(finders) if f is self), -1) + 1
        for finder in finders[start:]:
            find_spec = getattr(finder, "find_spec", None)
            if find_spec is None:
                continue
            spec = find_spec(fullname, path, target)
            if spec is not None:
                return spec
        return None

    def _module_executed(self, module: ModuleType) -> None:
        with self._lock:
            callbacks = self._pending.pop(module.__name__, [])
        self._run(module.__name__, module, callbacks)

    @staticmethod
    def _run(name: str, module: ModuleType, callbacks: List[Callback]) -> None:
        for callback in callbacks:
            try:
                callback(module)
            except Exception:  # the import that triggered us must still succeed
                logger.exception("post-import callback for %s failed", name)


_WATCHER_LOCK = threading.Lock()


def installed_watcher() -> Optional[PostImportWatcher]:
    """The process-wide watcher if one is in ``sys.meta_path`` (installs nothing)."""
    return next((f for f in sys.meta_path if isinstance(f, PostImportWatcher)), None)


def process_watcher() -> PostImportWatcher:
    """The process-wide watcher, put first in ``sys.meta_path`` on first use."""
    with _WATCHER_LOCK:
        watcher = installed_watcher()
        if watcher is None:
            watcher = PostImportWatcher()
            sys.meta_path.insert(0, watcher)
        return watcher
