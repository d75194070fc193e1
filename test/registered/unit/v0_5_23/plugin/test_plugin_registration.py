"""The plugin as SGLang 0.5.23 loads it: the entry point, the 0.5.23 line's table, every
hook and resolution step in place after ``load_plugins()``, registration idempotent, and a
broken or renamed target named by the check."""

import inspect
from importlib.metadata import entry_points
from pathlib import Path

import pytest
from sglang.srt.arg_groups import resolution_hooks
from sglang.srt.plugins.hook_registry import HookRegistry, HookType

from sglang_cp_hicache import plugin
from sglang_cp_hicache.v0_5_23 import hooks, resolution_steps
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, set_cp_shared_kv_enabled

OURS_CLI = "sglang_cp_hicache.v0_5_23.launch.cli"
OURS_RESOLUTION = "sglang_cp_hicache.v0_5_23.launch.resolution"


def _wrappers_of(step: hooks.ResolutionStep) -> list:
    return [fn for fn in resolution_hooks._HOOKS.get(step.step, ()) if fn is resolution_steps._step_wrappers.get(step)]


def test_entry_point_loads_plugin_register():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "cp_hicache"]
    assert len(eps) == 1
    assert eps[0].value == "sglang_cp_hicache.plugin:register"
    assert eps[0].load() is plugin.register


def test_plugin_picks_the_0_5_23_line():
    assert plugin.line_hooks() is hooks
    assert hooks.RELEASE == "0.5.23"


def test_load_plugins_puts_every_hook_and_step_in_place(plugins_loaded):
    assert hooks.missing_hooks() == []  # imports every target, sglang.srt.entrypoints.engine too
    from sglang.srt.entrypoints.engine import Engine
    from sglang.srt.server_args import ServerArgs

    for owner, name in ((ServerArgs, "add_cli_args"), (ServerArgs, "from_cli_args"), (Engine, "__init__")):
        assert getattr(owner, name) is not inspect.unwrap(getattr(owner, name)), name
    for step in hooks.RESOLUTION_STEPS:
        assert len(_wrappers_of(step)) == 1, step


def test_registration_is_idempotent(plugins_loaded):
    """SGLang registers plugins in every process, sometimes more than once per process."""
    hooks_before = {target: len(entries) for target, entries in HookRegistry._hooks.items()}
    steps_before = {name: list(fns) for name, fns in resolution_hooks._HOOKS.items()}
    plugin.register()
    hooks.register()
    assert {t: len(e) for t, e in HookRegistry._hooks.items()} == hooks_before
    assert {n: list(f) for n, f in resolution_hooks._HOOKS.items()} == steps_before
    assert hooks.missing_hooks(import_targets=False) == []


def test_every_table_entry_resolves_and_every_step_runs_in_upstreams_pipeline():
    for spec in hooks.HOOKS:
        HookType[spec.hook_type]
        target, hook = hooks.resolve(spec.target), hooks.resolve(spec.hook)
        assert callable(target) and callable(hook) and not isinstance(hook, type), spec
    # A name can stay overridable yet lose its call site; pipeline.py is where steps run.
    from sglang.srt.arg_groups import pipeline

    pipeline_source = Path(pipeline.__file__).read_text()
    for step in hooks.RESOLUTION_STEPS:
        assert step.step in resolution_hooks._OVERRIDABLE_HOOKS, step
        assert f"run_hook({step.step}, server_args)" in pipeline_source, step
        assert list(inspect.signature(hooks.resolve(step.hook)).parameters) == ["server_args", "previous"]


@pytest.fixture
def scratch_registry(monkeypatch):
    """Planted steps register into copies: the real pipeline and table are left as they were."""
    monkeypatch.setattr(resolution_steps, "_step_wrappers", dict(resolution_steps._step_wrappers))
    monkeypatch.setattr(resolution_steps, "_step_errors", dict(resolution_steps._step_errors))
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})


def test_broken_or_renamed_targets_are_named(plugins_loaded, scratch_registry, monkeypatch):
    unapplied = hooks.HookSpec("sglang.srt.server_args:ServerArgs.url", f"{OURS_CLI}:add_cli_args_after", "AFTER")
    renamed = hooks.HookSpec("sglang.srt.server_args:ServerArgs.no_such_method", "builtins:print", "AFTER")
    assert hooks.missing_hooks([unapplied]) == [f"{unapplied.dotted_target} (never registered in this process)"]
    assert hooks.missing_hooks([renamed])[0].startswith("sglang.srt.server_args.ServerArgs.no_such_method (")

    renamed_step = hooks.ResolutionStep("handle_no_such_step", f"{OURS_RESOLUTION}:refuse_and_enable_sharding")
    broken_step = hooks.ResolutionStep("handle_hicache", f"{OURS_RESOLUTION}:no_such_function")
    unregistered_step = hooks.ResolutionStep("handle_dwdp", f"{OURS_RESOLUTION}:refuse_and_enable_sharding")
    hooks.install_resolution_steps([renamed_step, broken_step])
    missing = hooks.missing_resolution_steps([renamed_step, broken_step, unregistered_step])
    assert missing[0].startswith("resolution step handle_no_such_step (ValueError: 'handle_no_such_step' is not")
    assert missing[1].startswith(f"resolution step handle_hicache ({OURS_RESOLUTION}:no_such_function: AttributeError")
    assert missing[2] == "resolution step handle_dwdp (never registered in this process)"
    assert hooks.missing_resolution_steps([broken_step], import_targets=False) == []
    # SGLang's list lost our wrapper (a reset registry): named, and registering again heals it.
    resolution_hooks._HOOKS["handle_kv_cache_sharding"] = []
    assert hooks.missing_resolution_steps(hooks.RESOLUTION_STEPS) == [
        "resolution step handle_kv_cache_sharding (not in SGLang's wrappers of this step)"
    ]
    hooks.install_resolution_steps(hooks.RESOLUTION_STEPS)
    assert hooks.missing_resolution_steps(hooks.RESOLUTION_STEPS) == []

    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (unapplied,))
    monkeypatch.setattr(hooks, "RESOLUTION_STEPS", hooks.RESOLUTION_STEPS + (renamed_step,))
    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url.*handle_no_such_step"):
        hooks.verify_hooks_installed()
    # Where the flag turns on, the check runs: parsing it, and resolving a record that has it.
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url"):
        prepare_server_args(["--model-path", "dummy", CLI_FLAG])
    record = ServerArgs(model_path="dummy")
    set_cp_shared_kv_enabled(record, True)
    with pytest.raises(hooks.PluginNotInstalledError, match="handle_no_such_step"):
        record.resolve_once()
