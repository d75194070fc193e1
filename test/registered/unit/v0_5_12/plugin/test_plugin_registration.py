"""The plugin as SGLang loads it: entry point, hooks, the flag, validation, flag-off parity."""

import copy
import hashlib
import inspect
import pickle
import subprocess
import sys
from importlib.metadata import entry_points

import pytest
import torch

from sglang_cp_hicache import plugin
from sglang_cp_hicache.v0_5_12 import hooks
from sglang_cp_hicache.v0_5_12.launch_check import check_server_args_after
from sglang_cp_hicache.v0_5_12.server_args import CLI_FLAG, FLAG, CpSharedKVConfigError
from sglang_cp_hicache.testing.dist import run_ranks

CP_ARGS = ["--model-path", "dummy", CLI_FLAG, "--enable-nsa-prefill-context-parallel"]


def test_entry_point_is_discoverable():
    eps = [ep for ep in entry_points(group="sglang.srt.plugins") if ep.name == "cp_hicache"]
    assert len(eps) == 1
    assert eps[0].value == "sglang_cp_hicache.plugin:register"
    assert eps[0].load() is plugin.register


def test_load_plugins_installs_every_hook(plugins_loaded):
    from sglang.srt.mem_cache import hiradix_cache

    assert hooks.missing_hooks() == []
    assert hiradix_cache.HiRadixCache.__name__ == "CpHiRadixCache"


def test_every_table_entry_resolves():
    from sglang.srt.plugins.hook_registry import HookType

    for spec in hooks.HOOKS:
        HookType[spec.hook_type]
        target, hook = hooks.resolve(spec.target), hooks.resolve(spec.hook)
        assert callable(target) and callable(hook), spec
        if spec.hook_type == "REPLACE":
            assert isinstance(hook, type) and issubclass(hook, inspect.unwrap(target)), spec
        else:
            assert not isinstance(hook, type), spec


def test_missing_hook_stops_startup(plugins_loaded, monkeypatch):
    unapplied = hooks.HookSpec(
        "sglang.srt.server_args:ServerArgs.url", "sglang_cp_hicache.v0_5_12.server_args:post_init_after", "AFTER"
    )
    typo = hooks.HookSpec("sglang.srt.server_args:ServerArgs.no_such_method", "builtins:print", "AFTER")
    unwatched = hooks.HookSpec("cp_hicache_no_such_module:f", "builtins:print", "AFTER")
    assert hooks.missing_hooks([unapplied]) == [f"{unapplied.dotted_target} (never registered in this process)"]
    assert hooks.missing_hooks([typo])[0].startswith(typo.dotted_target)
    assert hooks.missing_hooks([unwatched], import_targets=False) == [
        "cp_hicache_no_such_module.f (not watching for its module's import)"
    ]
    assert "ModuleNotFoundError" in hooks.missing_hooks([unwatched])[0]
    monkeypatch.setattr(hooks, "HOOKS", hooks.HOOKS + (unapplied, unwatched))
    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url.*cp_hicache_no_such_module"):
        hooks.verify_hooks_installed()
    # Turning the flag on is where the check runs.
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url"):
        prepare_server_args(CP_ARGS)
    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url"):
        from sglang.srt.server_args import ServerArgs

        ServerArgs(model_path="dummy", **{FLAG: True})
    # Pool initialisation in a scheduler runs the full check: every target imported.
    from types import SimpleNamespace

    from sglang_cp_hicache.v0_5_12.model_executor.model_runner_kv_cache_mixin import init_pools_around

    runner = SimpleNamespace(
        server_args=SimpleNamespace(**{FLAG: True}), token_to_kv_pool_allocator=None
    )
    with pytest.raises(hooks.PluginNotInstalledError, match="ServerArgs.url.*cp_hicache_no_such_module"):
        init_pools_around(lambda self: None, runner)


def test_cli_parsing_with_and_without_flag(plugins_loaded):
    from sglang.srt.server_args import prepare_server_args

    on = prepare_server_args(CP_ARGS)
    off = prepare_server_args(["--model-path", "dummy"])
    assert getattr(on, FLAG) is True
    assert getattr(off, FLAG) is False


def test_engine_style_kwargs_and_pickling(plugins_loaded):
    from sglang.srt.server_args import ServerArgs

    # Engine(**kw) builds ServerArgs(**kw) (its server_args_class); the engine module
    # itself needs the serving stack (uvloop, fastapi) that the CPU venv leaves out.
    args = ServerArgs(model_path="dummy", enable_nsa_prefill_context_parallel=True, **{FLAG: True})
    assert getattr(args, FLAG) is True
    assert getattr(pickle.loads(pickle.dumps(args)), FLAG) is True
    assert getattr(copy.deepcopy(args), FLAG) is True
    assert getattr(ServerArgs(model_path="dummy"), FLAG) is False


@pytest.mark.parametrize(
    "extra, offending",
    [
        ({}, "--enable-nsa-prefill-context-parallel"),
        ({"hicache_storage_backend": "file"}, "--hicache-storage-backend"),
        ({"enable_hisparse": True}, "--enable-hisparse"),
        (
            {"enable_hierarchical_cache": True, "hicache_io_backend": "kernel", "hicache_mem_layout": "page_first"},
            "no per-layer device->host op into a page_first host buffer",
        ),
        ({"disaggregation_mode": "decode"}, "--disaggregation-mode decode"),
        ({"use_ray": True}, "--use-ray"),
        ({"enable_return_routed_experts": True}, "--enable-return-routed-experts"),
    ],
)
def test_unsupported_combinations_fail_fast(plugins_loaded, extra, offending):
    from sglang.srt.server_args import ServerArgs

    kwargs = {"enable_nsa_prefill_context_parallel": True, **extra}
    if offending == "--enable-nsa-prefill-context-parallel":
        kwargs = {}
    with pytest.raises(CpSharedKVConfigError) as excinfo:
        ServerArgs(model_path="dummy", **{FLAG: True}, **kwargs)
    assert offending in str(excinfo.value)
    assert CLI_FLAG in str(excinfo.value)
    # The same combination without the flag is none of our business.
    if offending != "--disaggregation-mode decode":
        ServerArgs(model_path="dummy", **kwargs)


def test_unified_radix_tree_env_is_refused(plugins_loaded, monkeypatch):
    from sglang.srt.server_args import ServerArgs

    monkeypatch.setenv("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "1")
    with pytest.raises(CpSharedKVConfigError, match="SGLANG_ENABLE_UNIFIED_RADIX_TREE"):
        ServerArgs(
            model_path="dummy",
            enable_nsa_prefill_context_parallel=True,
            enable_hierarchical_cache=True,
            **{FLAG: True},
        )


def test_speculative_decoding_with_cp_hicache_is_accepted(plugins_loaded):
    """The draft's KV is kept on host with the target's (CpHiRadixCache + the scheduler
    hooks), so HiCache with the NSA MTP draft is no longer refused."""
    from sglang.srt.server_args import ServerArgs

    args = ServerArgs(
        model_path="dummy",
        enable_nsa_prefill_context_parallel=True,
        enable_hierarchical_cache=True,
        speculative_algorithm="EAGLE",
        **{FLAG: True},
    )
    assert getattr(args, FLAG) and args.enable_hierarchical_cache


@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE"])
def test_cli_speculative_decoding_with_cp_hicache_is_accepted_at_parse_and_launch(
    plugins_loaded, monkeypatch, algorithm
):
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    args = prepare_server_args(
        CP_ARGS
        + ["--disaggregation-mode", "prefill", "--enable-hierarchical-cache"]
        + ["--hicache-io-backend", "direct", "--speculative-algorithm", algorithm]
    )
    assert args.enable_hierarchical_cache and getattr(args, FLAG)
    check_server_args_after(None, args)


def test_cli_speculative_decoding_with_cp_hicache_still_refuses_what_cannot_work(plugins_loaded):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(CpSharedKVConfigError, match="--enable-multi-layer-eagle"):
        prepare_server_args(
            CP_ARGS
            + ["--enable-hierarchical-cache", "--speculative-algorithm", "NEXTN"]
            + ["--enable-multi-layer-eagle"]
        )


def test_scheduler_draft_hooks_are_in_place(plugins_loaded):
    """Upstream's MLA-only draft host pool registration is never what runs under the flag."""
    from sglang.srt.managers.scheduler import Scheduler

    for name, hook in (
        ("init_cache_with_memory_pool", "init_cache_with_memory_pool_around"),
        ("_maybe_register_hicache_draft", "maybe_register_hicache_draft_around"),
    ):
        assert f"sglang.srt.managers.scheduler.Scheduler.{name}" not in [
            line.split(" ")[0] for line in hooks.missing_hooks()
        ]
        assert getattr(Scheduler, name) is not inspect.unwrap(getattr(Scheduler, name)), name


@pytest.mark.parametrize("algorithm", ["NEXTN", "EAGLE"])
def test_nsa_mtp_speculative_decoding_is_accepted_at_parse_and_launch(plugins_loaded, monkeypatch, algorithm):
    from sglang.srt.server_args import prepare_server_args

    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    args = prepare_server_args(
        CP_ARGS + ["--disaggregation-mode", "prefill", "--speculative-algorithm", algorithm]
    )
    assert args.speculative_algorithm in ("NEXTN", "EAGLE") and getattr(args, FLAG)
    check_server_args_after(None, args)


@pytest.mark.parametrize("algorithm", ["EAGLE3", "STANDALONE", "NGRAM"])
def test_other_speculative_algorithms_are_refused_naming_the_supported_ones(plugins_loaded, algorithm):
    from sglang.srt.server_args import prepare_server_args

    extra = ["--speculative-draft-model-path", "dummy"] if algorithm != "NGRAM" else []
    with pytest.raises(CpSharedKVConfigError) as excinfo:
        prepare_server_args(CP_ARGS + ["--speculative-algorithm", algorithm] + extra)
    message = str(excinfo.value)
    assert f"got {algorithm}" in message and "NEXTN or EAGLE" in message and CLI_FLAG in message


@pytest.mark.parametrize(
    "changes, needle",
    [
        ({"enable_multi_layer_eagle": True}, "--enable-multi-layer-eagle"),
        ({"speculative_draft_attention_backend": "flashinfer"}, "--speculative-draft-attention-backend flashinfer"),
    ],
)
def test_draft_variants_outside_the_shared_kv_runtime_are_refused(plugins_loaded, changes, needle):
    from sglang.srt.server_args import ServerArgs

    from sglang_cp_hicache.v0_5_12.server_args import unsupported_combinations

    args = ServerArgs(model_path="dummy", enable_nsa_prefill_context_parallel=True, **{FLAG: True})
    args.speculative_algorithm = "EAGLE"
    assert unsupported_combinations(args) == []
    for name, value in changes.items():
        setattr(args, name, value)
    assert any(needle in p for p in unsupported_combinations(args))


def test_cli_storage_backend_fails_at_parse(plugins_loaded):
    from sglang.srt.server_args import prepare_server_args

    with pytest.raises(CpSharedKVConfigError, match="--hicache-storage-backend"):
        prepare_server_args(CP_ARGS + ["--hicache-storage-backend", "file"])


def test_real_launch_refuses_unsupported_serving_modes_and_accepts_prefill(
    plugins_loaded, monkeypatch
):
    from sglang.srt.server_args import ServerArgs

    colocated = ServerArgs(model_path="dummy", enable_nsa_prefill_context_parallel=True, **{FLAG: True})
    with pytest.raises(CpSharedKVConfigError, match="--disaggregation-mode prefill"):
        check_server_args_after(None, colocated)
    monkeypatch.setenv("SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER", "1")
    prefill = ServerArgs(
        model_path="dummy",
        enable_nsa_prefill_context_parallel=True,
        disaggregation_mode="prefill",
        **{FLAG: True},
    )
    check_server_args_after(None, prefill)  # no static guard: the ranks self-test at init
    check_server_args_after(None, ServerArgs(model_path="dummy"))


def test_flag_in_launch_server_help():
    # The CPU runtime stands in for the GPU stack; the rest is SGLang's own launcher.
    code = (
        "import sys, runpy\n"
        "from sglang_cp_hicache.testing import install\n"
        "install()\n"
        "sys.argv = ['launch_server', '--help']\n"
        "runpy.run_module('sglang.launch_server', run_name='__main__')\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert CLI_FLAG in out.stdout


# ------------------------------------------------------------- flag off: parity
def _upstream_round_trip(ctx, with_plugin: bool):
    """Write-through, device eviction, host hit, load back on upstream non-CP HiCache."""
    from sglang.srt.mem_cache import hiradix_cache
    from sglang.srt.mem_cache.base_prefix_cache import (
        EvictParams,
        InitLoadBackParams,
        InsertParams,
        MatchPrefixParams,
    )

    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    if with_plugin:
        import sglang.srt.plugins as sglang_plugins

        sglang_plugins.load_plugins()
    cache_cls = hiradix_cache.HiRadixCache
    cfg = nsa_stack.StackConfig(cp_size=1)
    # Built through the class the scheduler would see after load_plugins().
    stack = nsa_stack.build_rank_stack(
        cfg, 0, None, ctx.attn_tp_group, shared_kv=False, cache_cls=cache_cls
    )
    tokens = list(range(500, 500 + 64 * 4))
    locs = stack.allocator.alloc(len(tokens))
    ids, pos = torch.tensor(tokens), torch.arange(len(tokens))
    nsa_stack.write_prefill_kv(stack, locs, ids, pos)
    stack.cache.insert(InsertParams(key=nsa_stack.radix_key(tokens), value=locs))
    stack.cache.check_hicache_events()
    stack.cache.evict(EvictParams(num_tokens=len(tokens)))
    nsa_stack.wipe_device_kv(stack)
    match = stack.cache.match_prefix(MatchPrefixParams(key=nsa_stack.radix_key(tokens)))
    loaded, _ = stack.cache.init_load_back(
        InitLoadBackParams(best_match_node=match.best_match_node, host_hit_length=match.host_hit_length)
    )
    stack.cache.ready_to_load_host_cache()
    stack.cache.check_hicache_events()
    digest = hashlib.sha256()
    for layer in range(cfg.layer_num):
        digest.update(stack.kv_pool.kv_buffer[layer].view(torch.uint8).numpy().tobytes())
        digest.update(stack.kv_pool.index_k_with_scale_buffer[layer].numpy().tobytes())
    return {
        "cache_class": cache_cls.__name__,
        "host_hit": match.host_hit_length,
        "loaded": loaded.tolist(),
        "mismatches": nsa_stack.count_kv_mismatches(stack, loaded, ids, pos),
        "device_bytes": digest.hexdigest(),
    }


def test_flag_off_round_trip_is_unchanged_by_plugin():
    without, with_ = (run_ranks(1, _upstream_round_trip, flag)[0] for flag in (False, True))
    assert without["cache_class"] == "HiRadixCache"
    assert with_["cache_class"] == "CpHiRadixCache"
    assert without["host_hit"] == 64 * 4 and without["mismatches"] == 0
    for key in ("host_hit", "loaded", "mismatches", "device_bytes"):
        assert with_[key] == without[key], key
