"""Deferred hooks: applied right after their target module is imported, or at once if it is.

Throwaway modules in a temp dir stand in for SGLang targets and plugin hook modules.
"""

import importlib
import sys
import textwrap
import uuid

import pytest
from sglang.srt.plugins.hook_registry import HookRegistry

from sglang_cp_hicache import hook_table as hooks
from sglang_cp_hicache.core.import_watcher import PostImportWatcher


@pytest.fixture
def modules(tmp_path, monkeypatch):
    """Writes modules into a temp dir on ``sys.path``; forgets them and their hooks after."""
    monkeypatch.syspath_prepend(str(tmp_path))
    written = []

    def write(source: str) -> str:
        name = f"cp_hicache_probe_{uuid.uuid4().hex[:10]}"
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
        written.append(name)
        return name

    yield write
    importlib.invalidate_caches()
    for name in written:
        sys.modules.pop(name, None)
    for spec in [s for s in hooks._handed if s.module in written]:
        hooks._handed.pop(spec)
        hooks._deferred.discard(spec)
        HookRegistry._hooks.pop(spec.dotted_target, None)
        HookRegistry._patched.discard(spec.dotted_target)


@pytest.fixture
def watcher():
    watcher = PostImportWatcher()
    sys.meta_path.insert(0, watcher)
    yield watcher
    sys.meta_path.remove(watcher)


TARGET = """
def greet():
    return "hi"
"""
# Appends one "!" per application, so a hook applied twice shows.
HOOK = """
def shout(original):
    return original() + "!"
"""


def _spec(target: str, hook: str) -> hooks.HookSpec:
    return hooks.HookSpec(f"{target}:greet", f"{hook}:shout", "AROUND")


def test_deferred_hook_applies_when_its_module_is_imported(modules):
    target, hook = modules(TARGET), modules(HOOK)
    spec = _spec(target, hook)
    hooks.install([spec])
    hooks.install([spec])  # idempotent: still applied once
    assert target not in sys.modules
    assert hooks.missing_hooks([spec], import_targets=False) == []

    from_import = modules(f"from {target} import greet\n")
    module = importlib.import_module(from_import)  # imports the target first

    assert module.greet() == "hi!"  # no apply_hooks() call in between
    assert sys.modules[target].greet() == "hi!"
    assert hooks.missing_hooks([spec]) == []


def test_hook_callable_is_imported_on_first_call(modules):
    target, hook = modules(TARGET), modules(HOOK)
    hooks.install([_spec(target, hook)])
    module = importlib.import_module(target)
    assert hook not in sys.modules
    assert module.greet() == "hi!"
    assert hook in sys.modules


def test_hook_on_imported_module_applies_with_load_plugins(modules):
    target, hook = modules(TARGET), modules(HOOK)
    spec = _spec(target, hook)
    module = importlib.import_module(target)
    hooks.install([spec])
    hooks.install([spec])  # idempotent: still applied once
    # Registered, not applied: load_plugins() applies right after the plugins register.
    assert module.greet() == "hi"
    assert hooks.missing_hooks([spec]) == [f"{spec.dotted_target} (not in the installed chain)"]
    HookRegistry.apply_hooks()
    assert module.greet() == "hi!"
    assert hooks.missing_hooks([spec]) == []


def test_full_check_imports_the_target_and_names_a_broken_hook(modules):
    target = modules(TARGET)
    spec = hooks.HookSpec(f"{target}:greet", f"{target}:no_such_hook", "AROUND")
    hooks.install([spec])
    assert target not in sys.modules
    [why] = hooks.missing_hooks([spec])
    assert target in sys.modules
    assert why.startswith(spec.dotted_target) and "no_such_hook" in why


def test_watcher_runs_callback_after_the_body_with_the_real_loader(modules, watcher):
    name = modules(TARGET)
    seen = []

    def record(module):
        seen.append((module.greet(), type(module.__loader__).__name__))

    assert watcher.when_imported(name, record) is False
    assert watcher.pending() == (name,)
    importlib.import_module(name)
    assert seen == [("hi", "SourceFileLoader")]
    assert sys.modules[name].__spec__.loader is sys.modules[name].__loader__
    assert watcher.pending() == ()
    # Already imported: runs at once.
    assert watcher.when_imported(name, lambda m: seen.append("now")) is True
    assert seen[-1] == "now"


def test_failed_import_keeps_the_callback_and_a_failing_callback_keeps_the_import(
    modules, watcher, tmp_path
):
    name = modules("raise RuntimeError('broken body')\n")
    seen = []
    watcher.when_imported(name, seen.append)
    with pytest.raises(RuntimeError, match="broken body"):
        importlib.import_module(name)
    assert seen == [] and watcher.pending() == (name,)

    (tmp_path / f"{name}.py").write_text(TARGET)
    importlib.invalidate_caches()
    watcher.when_imported(name, lambda m: 1 / 0)
    assert importlib.import_module(name).greet() == "hi"
    assert [m.__name__ for m in seen] == [name]
