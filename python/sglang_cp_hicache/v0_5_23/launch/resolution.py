"""The resolution steps of ``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23, where the
mode is decided once (see ``launch.RESOLUTION_STEPS``).

* :func:`refuse_and_enable_sharding` wraps ``validate_prefill_cp_platform``, which runs for
  every record (the dummy-model path too) before the model is resolved or downloaded:
  every configuration refusal at once (``refusals.py``), in one message starting with the
  flag, then the sharding declaration. It must precede upstream's first reader of
  ``enable_kv_cache_sharding``, ``handle_gpu_memory_settings`` (``pipeline.py:218`` ->
  ``overrides.py:1799``), which runs long before the gate (``pipeline.py:284``).
* :func:`refuse_unsupported_model` wraps the gate itself: once the model is known, a model
  outside the DSA family is refused; then upstream's gate runs with every rule but its
  storage refusal, which the plugin's file / mooncake L3 backends lift (``gate_view.py``).
"""

from __future__ import annotations

import logging
from typing import Any, Callable

from sglang_cp_hicache.hook_table import PluginNotInstalledError
from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode, store_mode
from sglang_cp_hicache.v0_5_23.launch.flag import (
    CLI_FLAG,
    DECLARATION_SOURCE,
    CpSharedKVConfigError,
    verify_plugin_installed,
)
from sglang_cp_hicache.v0_5_23.launch.gate_view import storage_hidden_from_gate
from sglang_cp_hicache.v0_5_23.launch.refusals import (
    is_single_prefill_rank,
    refuse,
    single_rank_problems,
    unsupported_combinations,
    unsupported_models,
)

logger = logging.getLogger(__name__)


def decide_mode(requested: CpMode, cfg: Any) -> CpMode:
    """The server's mode, from the mode the record asks for (the flag's
    :attr:`CpMode.SHARDED`, or one settled by an earlier run of the step) and ``cfg`` (a
    resolution view before the model is resolved): one prefill rank
    (``refusals.is_single_prefill_rank``) makes the flag a one-rank L3 reader. The one
    place the mode is decided; once settled it stays."""
    if requested is CpMode.SHARDED and is_single_prefill_rank(cfg):
        return CpMode.ONE_RANK_L3_READER
    return requested


def refuse_and_enable_sharding(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Wraps ``validate_prefill_cp_platform``: decide the mode (:func:`decide_mode`),
    refuse every unsupported configuration at once, then declare
    ``enable_kv_cache_sharding`` so every later step, upstream's gate first among them,
    sees sharding on. Runs twice per resolution (the step is called again from
    ``handle_context_parallelism``), so it decides and declares only once.

    One prefill rank: upstream refuses DSA sharding at CP size 1 and there is nothing to
    shard, so sharding is not declared; the record's mode becomes
    :attr:`CpMode.ONE_RANK_L3_READER` and the flag selects only the owner-free L3 keys."""
    requested = cp_mode(server_args)
    if requested is not CpMode.OFF:
        from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

        verify_plugin_installed()
        cfg = resolving_view(server_args)
        mode = decide_mode(requested, cfg)
        problems = unsupported_combinations(cfg)
        one_rank = mode is CpMode.ONE_RANK_L3_READER
        refuse(problems + single_rank_problems(cfg) if one_rank else problems)
        if mode is not requested:
            store_mode(server_args, mode)
            logger.info(
                "%s on one prefill rank: no KV sharding; L3 %s uses the owner-free keys of "
                "sharded servers",
                CLI_FLAG,
                cfg.hicache_storage_backend,
            )
        elif mode.shards_kv and not cfg.enable_kv_cache_sharding:
            declare_resolution(server_args, DECLARATION_SOURCE, enable_kv_cache_sharding=True)
    previous(server_args)


def _refuse_resharded_single_rank(server_args: Any) -> None:
    """One prefill rank was decided before the model resolved the CP size; a resolved CP
    size above 1 (or sharding declared elsewhere) contradicts it: refuse, never serve an
    unsharded stack across CP ranks."""
    from sglang.srt.arg_groups.overrides import resolving_view

    cfg = resolving_view(server_args)
    if cfg.attn_cp_size != 1 or cfg.enable_kv_cache_sharding:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: --tp 1 was taken as one prefill rank (no KV sharding), but "
            f"resolution gave attn_cp_size {cfg.attn_cp_size} and enable_kv_cache_sharding "
            f"{cfg.enable_kv_cache_sharding}; give --tp equal to the prefill CP size"
        )


def refuse_unsupported_model(server_args: Any, previous: Callable[[Any], None]) -> None:
    """Wraps upstream's sharding gate: refuse a model outside the DSA family, then run the
    gate with every rule but its storage refusal (an admitted L3 backend is hidden from it,
    ``gate_view.storage_hidden_from_gate``). One prefill rank: the model rule, the resolved
    CP size 1, then upstream's gate as is (sharding off, it checks nothing)."""
    mode = cp_mode(server_args)
    if mode is CpMode.ONE_RANK_L3_READER:
        refuse(unsupported_models(server_args))
        _refuse_resharded_single_rank(server_args)
        previous(server_args)
        return
    if mode.shards_kv:
        from sglang.srt.arg_groups.overrides import resolving_view

        if not resolving_view(server_args).enable_kv_cache_sharding:
            # Another plugin replaced validate_prefill_cp_platform without calling previous.
            raise PluginNotInstalledError(
                f"{CLI_FLAG}: KV sharding is off at upstream's gate, so the plugin's step on "
                "validate_prefill_cp_platform did not run; another plugin's override of that "
                "step must call previous(server_args)"
            )
        refuse(unsupported_models(server_args))
        with storage_hidden_from_gate():
            previous(server_args)
        return
    previous(server_args)


__all__ = ["decide_mode", "refuse_and_enable_sharding", "refuse_unsupported_model"]
