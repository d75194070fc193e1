"""``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23, through the real ``ServerArgs``,
``Engine.__init__`` and resolution pipeline: the flag from the CLI and from ``Engine``
keywords, pickling, sharding turned on before upstream's gate, every refusal, the 0.5.12
spellings, and flag-off records identical to upstream's.

Model-backed cases resolve a tiny local GLM-5 (or Llama) ``config.json`` on the CPU; only
the GPU's compute capability, which DSA resolution asks for, is faked.
"""

import argparse
import atexit
import copy
import importlib.util
import inspect
import logging
import pickle
import sys
from pathlib import Path

import msgspec
import pytest
import torch
from sglang.srt.arg_groups import resolution_hooks
from sglang.srt.arg_groups.overrides import resolution_result, resolving_view
from sglang.srt.server_args import ServerArgs, prepare_server_args

from sglang_cp_hicache.v0_5_23.launch.flag import (
    CLI_FLAG,
    DECLARATION_SOURCE,
    FLAG,
    CpSharedKVConfigError,
    set_cp_shared_kv_enabled,
)
from sglang_cp_hicache.v0_5_23.launch.cp_mode import MODE_ATTR, CpMode, cp_mode

ROOT = Path(__file__).resolve().parents[5]
# A PD prefill worker with interleave prefill CP: everything the flag needs.
VALID = ["--enable-prefill-cp", "--cp-strategy", "interleave", "--disaggregation-mode", "prefill"]
DUMMY = ["--model-path", "dummy"]


def prepare_and_resolve(argv):
    record = prepare_server_args(argv)
    record.resolve_once()
    return record


def _declarations(record, field="enable_kv_cache_sharding"):
    return [source for source, fields in getattr(record, "_resolved_overrides", ()) if field in fields]


@pytest.fixture(autouse=True)
def _plugins(plugins_loaded):
    """Every test parses with the plugin loaded the way SGLang loads it."""


@pytest.fixture(scope="module")
def glm5_model(tmp_path_factory):
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig

    path = tmp_path_factory.mktemp("glm5")
    GlmMoeDsaConfig(
        num_hidden_layers=2, architectures=["GlmMoeDsaForCausalLM"], num_nextn_predict_layers=1
    ).save_pretrained(path)
    return ["--model-path", str(path), "--device", "cpu", "--tp", "2"]


@pytest.fixture(scope="module")
def llama_model(tmp_path_factory):
    from transformers import LlamaConfig

    path = tmp_path_factory.mktemp("llama")
    LlamaConfig(num_hidden_layers=2, architectures=["LlamaForCausalLM"]).save_pretrained(path)
    return ["--model-path", str(path), "--device", "cpu", "--tp", "2"]


@pytest.fixture
def gpu_capability(monkeypatch):
    """DSA resolution asks the GPU for its compute capability (model_hook.py:341)."""
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *args, **kwargs: (9, 0))


# ------------------------------------------------------------------ the CLI
def test_cli_flag_turns_on_the_record():
    on = prepare_server_args(DUMMY + [CLI_FLAG])
    off = prepare_server_args(DUMMY)
    assert cp_mode(on) is CpMode.SHARDED and cp_mode(off) is CpMode.OFF
    assert MODE_ATTR not in vars(off)  # flag off: nothing of ours on the record


def test_upstream_from_cli_args_alone_drops_the_flag():
    """Why the AROUND exists: from_cli_args copies record fields only."""
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    namespace = parser.parse_args(DUMMY + [CLI_FLAG])
    assert getattr(namespace, FLAG) is True
    assert cp_mode(inspect.unwrap(ServerArgs.from_cli_args)(ServerArgs, namespace)) is CpMode.OFF
    assert cp_mode(ServerArgs.from_cli_args(namespace)) is CpMode.SHARDED
    assert CLI_FLAG in parser.format_help()


def test_the_reader_counts_only_a_stored_mode():
    from unittest.mock import MagicMock

    assert cp_mode(MagicMock()) is CpMode.OFF  # answers every attribute, holds no mode
    assert cp_mode(object()) is CpMode.OFF
    record = ServerArgs(model_path="dummy")
    set_cp_shared_kv_enabled(record, True)
    assert cp_mode(resolving_view(record)) is CpMode.SHARDED  # resolution views read through


# ----------------------------------------------------------------- the Engine
class _LaunchStopped(Exception):
    def __init__(self, engine, server_args):
        super().__init__("launch stopped by the test")
        self.engine, self.server_args = engine, server_args


@pytest.fixture
def engine_without_launch(monkeypatch):
    """The real Engine.__init__, stopped where it would start processes."""
    from sglang.srt.entrypoints import engine

    def stop_launch(self, *, server_args, **kwargs):
        raise _LaunchStopped(self, server_args)

    monkeypatch.setattr(engine.Engine, "_launch_subprocesses", stop_launch)
    monkeypatch.setattr(atexit, "register", lambda fn, *a, **k: fn)  # no shutdown at exit

    def build(**kwargs):
        with pytest.raises(_LaunchStopped) as stopped:
            engine.Engine(**kwargs)
        return stopped.value

    return build


def test_engine_keyword_turns_on_the_record_engine_builds(engine_without_launch):
    stopped = engine_without_launch(model_path="dummy", **{FLAG: True}, enable_prefill_cp=True)
    assert cp_mode(stopped.server_args) is CpMode.SHARDED and stopped.server_args.enable_prefill_cp
    assert stopped.server_args.log_level == "error"  # upstream's construction ran as is
    assert "server_args_class" not in vars(stopped.engine)  # the instance shadow is gone
    off = engine_without_launch(model_path="dummy", **{FLAG: False})
    assert cp_mode(off.server_args) is CpMode.OFF and MODE_ATTR not in vars(off.server_args)
    given = ServerArgs(model_path="dummy")
    assert cp_mode(engine_without_launch(server_args=given, **{FLAG: True}).server_args) is CpMode.SHARDED


def test_engine_accepts_the_0_5_12_keywords_only_with_the_flag(engine_without_launch):
    legacy = {"enable_nsa_prefill_context_parallel": True, "nsa_prefill_cp_mode": "round-robin-split"}
    stopped = engine_without_launch(model_path="dummy", **{FLAG: True}, **legacy)
    assert (stopped.server_args.enable_prefill_cp, stopped.server_args.cp_strategy) == (True, "interleave")
    with pytest.raises(CpSharedKVConfigError, match="--enable-prefill-cp --cp-strategy interleave"):
        engine_without_launch(model_path="dummy", **legacy)


# ----------------------------------------------------------------- pickling
def test_flag_and_sharding_declaration_survive_pickling():
    record = prepare_server_args(DUMMY + [CLI_FLAG] + VALID)
    assert cp_mode(pickle.loads(pickle.dumps(record))) is CpMode.SHARDED  # before resolution
    record.resolve_once()
    for copied in (pickle.loads(pickle.dumps(record)), copy.deepcopy(record)):
        assert cp_mode(copied) is CpMode.SHARDED
        assert resolution_result(copied, "enable_kv_cache_sharding") is True
        assert copied._resolution_finished
    with pytest.raises(CpSharedKVConfigError, match="already resolved"):
        set_cp_shared_kv_enabled(prepare_and_resolve(DUMMY), True)


# --------------------------------------------------- resolution turns sharding on
def test_resolution_declares_sharding_once():
    on = prepare_and_resolve(DUMMY + [CLI_FLAG] + VALID)
    assert resolution_result(on, "enable_kv_cache_sharding") is True
    assert on.enable_kv_cache_sharding is False  # the operator's input is left as given
    assert _declarations(on) == [DECLARATION_SOURCE]
    off = prepare_and_resolve(DUMMY + VALID)
    assert resolution_result(off, "enable_kv_cache_sharding") is False and _declarations(off) == []
    both = prepare_and_resolve(DUMMY + [CLI_FLAG, "--enable-kv-cache-sharding"] + VALID)
    assert resolution_result(both, "enable_kv_cache_sharding") is True and _declarations(both) == []


def test_the_published_config_has_sharding_on():
    """What upstream's sharded pools, allocator and PD transfer read (get_parallel())."""
    from sglang.srt.runtime_context import get_parallel, publish, restore_context, snapshot_context

    before = snapshot_context()
    try:
        for argv, sharded in ((DUMMY + [CLI_FLAG] + VALID, True), (DUMMY + VALID, False)):
            publish(prepare_and_resolve(argv), role="scheduler")
            assert get_parallel().enable_kv_cache_sharding is sharded
    finally:
        restore_context(before)


@pytest.fixture
def sharding_seen_at(monkeypatch):
    """Records whether sharding is on when named upstream steps run (probes registered
    after ours run outermost, i.e. before ours at the same step)."""
    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})
    seen = {}

    def probe(name):
        def observe(server_args, previous):
            seen.setdefault(name, resolving_view(server_args).enable_kv_cache_sharding)
            previous(server_args)

        resolution_hooks.register_resolution_hook(name)(observe)

    for name in ("handle_gpu_memory_settings", "handle_kv_cache_sharding"):
        probe(name)
    return seen


def test_sharding_is_on_from_upstreams_first_reader_to_its_gate(glm5_model, gpu_capability, sharding_seen_at):
    argv = glm5_model + VALID + ["--attention-backend", "dsa"]
    # On the CPU upstream's gate, which ran with sharding on, refuses at its CUDA check.
    with pytest.raises(ValueError, match="DSA KV sharding requires CUDA"):
        prepare_and_resolve(argv + [CLI_FLAG])
    assert sharding_seen_at == {"handle_gpu_memory_settings": True, "handle_kv_cache_sharding": True}
    sharding_seen_at.clear()
    off = prepare_and_resolve(argv)
    assert sharding_seen_at == {"handle_gpu_memory_settings": False, "handle_kv_cache_sharding": False}
    assert resolution_result(off, "enable_kv_cache_sharding") is False


# ---------------------------------------------------------------- the refusals
REFUSALS = [
    (["--enable-prefill-cp"], [], "needs prefill context parallelism: --enable-prefill-cp --cp-strategy interleave"),
    (["--cp-strategy", "interleave"], ["--cp-strategy", "zigzag"], "got --cp-strategy zigzag"),
    (["--disaggregation-mode", "prefill"], [], "--disaggregation-mode prefill), got --disaggregation-mode null"),
    (["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"], "got --disaggregation-mode decode"),
    ([], ["--enable-hierarchical-cache", "--hicache-storage-backend", "hf3fs"], "--hicache-storage-backend file or mooncake only (got hf3fs)"),
    ([], ["--enable-hisparse"], "does not support --enable-hisparse"),
    ([], ["--use-ray"], "does not support --use-ray"),
    ([], ["--enable-return-routed-experts"], "does not support --enable-return-routed-experts"),
    ([], ["--enable-return-indexer-topk"], "does not support --enable-return-indexer-topk"),
    ([], ["--radix-cache-backend", "mine"], "not --radix-cache-backend mine"),
    ([], ["--speculative-algorithm", "NEXTN"], "--speculative-algorithm NEXTN: write EAGLE"),
    (
        [],
        ["--speculative-algorithm", "NGRAM"],
        "--speculative-algorithm EAGLE only (the one-layer NextN MTP draft), got --speculative-algorithm NGRAM",
    ),
    ([], ["--speculative-algorithm", "EAGLE"], "needs --speculative-eagle-topk 1 (got None"),
    (
        [],
        ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1", "--enable-multi-layer-eagle"],
        "not --enable-multi-layer-eagle",
    ),
    (
        [],
        ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
        + ["--speculative-draft-attention-backend", "fa3"],
        "got --speculative-draft-attention-backend fa3",
    ),
]


def _without(argv, removed):
    if not removed:
        return list(argv)
    start = argv.index(removed[0])
    return argv[:start] + argv[start + len(removed):]


@pytest.mark.parametrize("removed, added, needle", REFUSALS, ids=[r[2][:40] for r in REFUSALS])
def test_each_refusal_names_the_flag_and_the_0_5_23_spelling(removed, added, needle):
    argv = DUMMY + _without(VALID, removed) + added
    with pytest.raises(CpSharedKVConfigError) as refused:
        prepare_and_resolve(argv + [CLI_FLAG])
    message = str(refused.value)
    assert message.startswith(f"{CLI_FLAG}: ") and needle in message
    assert message.count(f"{CLI_FLAG}:") == 1
    prepare_and_resolve(argv)  # without the flag, none of our business


def test_a_conflicting_tree_core_is_refused(monkeypatch):
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "rust")
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND='rust'"):
        prepare_and_resolve(DUMMY + VALID + [CLI_FLAG])
    prepare_and_resolve(DUMMY + VALID + [CLI_FLAG, "--disable-radix-cache"])  # no tree, no conflict
    monkeypatch.setenv("SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND", "python")
    prepare_and_resolve(DUMMY + VALID + [CLI_FLAG])


def test_every_refusal_is_reported_at_once():
    argv = DUMMY + [CLI_FLAG, "--enable-hisparse", "--use-ray", "--speculative-algorithm", "NEXTN"]
    with pytest.raises(CpSharedKVConfigError) as refused:
        prepare_and_resolve(argv)
    needles = ("--enable-prefill-cp", "--disaggregation-mode prefill", "--enable-hisparse", "--use-ray", "NEXTN")
    assert all(needle in str(refused.value) for needle in needles), str(refused.value)


def test_the_supported_draft_is_accepted():
    argv = DUMMY + VALID + [CLI_FLAG, "--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1"]
    assert resolution_result(prepare_and_resolve(argv), "enable_kv_cache_sharding") is True


def test_a_model_outside_the_dsa_family_is_refused(llama_model, glm5_model, gpu_capability):
    with pytest.raises(CpSharedKVConfigError) as refused:
        prepare_and_resolve(llama_model + VALID + [CLI_FLAG])
    assert str(refused.value).startswith(f"{CLI_FLAG}: needs a DSA sparse-attention model")
    assert "got LlamaForCausalLM" in str(refused.value)
    with pytest.raises(ValueError, match="DSA KV sharding") as upstream:  # GLM-5 passes on to the gate
        prepare_and_resolve(glm5_model + VALID + [CLI_FLAG])
    assert not isinstance(upstream.value, CpSharedKVConfigError)


def test_a_bypassed_first_step_stops_at_the_gate(glm5_model, gpu_capability, monkeypatch):
    """Another plugin overriding validate_prefill_cp_platform without calling previous."""
    from sglang_cp_hicache.v0_5_23.hooks import PluginNotInstalledError

    monkeypatch.setattr(resolution_hooks, "_HOOKS", {k: list(v) for k, v in resolution_hooks._HOOKS.items()})
    resolution_hooks.register_resolution_hook("validate_prefill_cp_platform")(lambda server_args, previous: None)
    with pytest.raises(PluginNotInstalledError, match="did not run"):
        prepare_and_resolve(glm5_model + VALID + [CLI_FLAG])


# --------------------------------------------------------- the 0.5.12 spellings
def _glm5_pd():
    spec = importlib.util.spec_from_file_location("glm5_pd", ROOT / "scripts" / "glm5" / "glm5_pd.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def deprecations(monkeypatch):
    """The plugin's deprecation warnings, on a fresh once-per-process memory (a handler on
    our logger: SGLang's parsing replaces the root logger's handlers)."""
    from sglang_cp_hicache.v0_5_23.launch import legacy_spellings

    monkeypatch.setattr(legacy_spellings, "_warned_spellings", set())
    told = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: told.append(record.getMessage())
    legacy_spellings.logger.addHandler(handler)
    yield told
    legacy_spellings.logger.removeHandler(handler)


def test_the_missions_launch_command_runs_on_0_5_23(deprecations):
    """scripts/glm5/glm5_pd.py's prefill server, spelled for 0.5.12, parses and passes the
    plugin's validation (the dummy model stands in for the checkpoint)."""
    glm5_pd = _glm5_pd()
    command = glm5_pd.prefill_command(glm5_pd.Deployment())
    argv = command[command.index("sglang.launch_server") + 1:]
    argv[argv.index("--model-path") + 1] = "dummy"
    record = prepare_and_resolve(argv)
    assert cp_mode(record) is CpMode.SHARDED and (record.enable_prefill_cp, record.cp_strategy) == (True, "interleave")
    assert resolution_result(record, "enable_kv_cache_sharding") is True
    prepare_and_resolve(argv)
    assert len(deprecations) == 1  # told once per process
    assert deprecations[0].startswith("--enable-nsa-prefill-context-parallel is the SGLang 0.5.12 spelling")
    assert "means --enable-prefill-cp" in deprecations[0]


@pytest.mark.parametrize(
    "legacy, strategy",
    [
        (["--enable-nsa-prefill-context-parallel"], "interleave"),
        (["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "round-robin-split"], "interleave"),
        (["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "in-seq-split"], "zigzag"),
        (["--enable-nsa-prefill-context-parallel", "--cp-strategy", "zigzag"], "zigzag"),
    ],
)
def test_old_spellings_map_to_the_new_ones_with_the_flag(legacy, strategy):
    record = prepare_server_args(DUMMY + [CLI_FLAG] + legacy)
    assert (record.enable_prefill_cp, record.cp_strategy) == (True, strategy)


def test_old_spellings_are_refused_without_the_flag_or_when_contradicted():
    with pytest.raises(CpSharedKVConfigError, match="SGLang 0.5.23 removed.*--enable-prefill-cp --cp-strategy"):
        prepare_server_args(DUMMY + ["--enable-nsa-prefill-context-parallel"])
    with pytest.raises(CpSharedKVConfigError, match="in-seq-split means --cp-strategy zigzag.*interleave"):
        prepare_server_args(DUMMY + [CLI_FLAG, "--nsa-prefill-cp-mode", "in-seq-split", "--cp-strategy", "interleave"])


# ------------------------------------------------------- flag off: upstream's record
def _upstream_record(argv, monkeypatch):
    """The same argv through upstream's own parser, from_cli_args and pipeline, none of the
    plugin's hooks or steps in the way."""
    parser = argparse.ArgumentParser()
    inspect.unwrap(ServerArgs.add_cli_args)(parser)
    record = inspect.unwrap(ServerArgs.from_cli_args)(ServerArgs, parser.parse_args(argv))
    with monkeypatch.context() as scoped:
        scoped.setattr(resolution_hooks, "_HOOKS", {})
        record.resolve_once()
    return record


def _snapshot(record):
    bookkeeping = {k: v for k, v in vars(record).items() if k != "_model_config"}  # a memo
    return msgspec.structs.asdict(record), bookkeeping, record.resolved_dict()


@pytest.mark.parametrize("model", ["dummy", "glm5"])
def test_flag_off_record_is_upstreams(model, glm5_model, gpu_capability, monkeypatch):
    argv = (DUMMY if model == "dummy" else glm5_model) + VALID + ["--enable-hierarchical-cache"]
    argv += ["--random-seed", "0"]  # resolution draws one otherwise
    ours = ServerArgs.from_cli_args(_parser_with_plugin().parse_args(argv))
    ours.resolve_once()
    assert _snapshot(ours) == _snapshot(_upstream_record(argv, monkeypatch))


def _parser_with_plugin():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    return parser
