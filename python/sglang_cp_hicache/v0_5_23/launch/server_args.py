"""``--enable-nsa-prefill-cp-shared-kv`` on SGLang 0.5.23: CLI, ``Engine(**kwargs)``,
pickling, resolution and validation.

Meaning: the flag is upstream's ``--enable-kv-cache-sharding`` (each prefill-CP rank stores
only the KV pages it owns, owner = logical page % cp_size) plus the plugin's deltas. Every
upstream sharding rule applies unchanged: a resolution step declares
``enable_kv_cache_sharding=True`` before upstream's gate (``handle_kv_cache_sharding``) runs.
On one prefill rank with L3 storage (``--tp 1 --hicache-storage-backend file|mooncake``: CP
size 1, nothing to shard, and upstream refuses DSA sharding there) the flag means an
unsharded stack whose L3 backend uses the plugin's owner-free keys, so it reads a sharded
fleet's pages (``docs/l3_storage.md``). Which of the two a server runs is its
:class:`~sglang_cp_hicache.v0_5_23.launch.cp_mode.CpMode`, decided once here
(:func:`decide_mode`) and read by startup code from the record (``cp_mode.cp_mode``).

How the flag travels, given that 0.5.23's ``ServerArgs`` is a sealed msgspec struct whose
Python ``__init__`` never runs:

* ``add_cli_args`` (AFTER) adds the option; parsing it proves the plugin's hooks are in
  place (:class:`_EnableAction`).
* ``from_cli_args`` (AROUND) copies the parsed value onto the record, which upstream's
  ``from_cli_args`` would drop (it copies record fields only).
* ``Engine.__init__`` (AROUND) takes the keyword off before Engine builds its record. Only
  once plugins are loaded in the process: the first ``Engine(...)`` of a fresh process
  enters the unhooked ``__init__``, whose own ``load_plugins()`` comes too late for that
  call, and msgspec rejects the keyword ("Unexpected keyword argument"). Call
  ``sglang.srt.plugins.load_plugins()`` before the first Engine, or pass
  ``server_args=prepare_server_args([..., "--enable-nsa-prefill-cp-shared-kv"])``.
* On the record it is the mode, the underscore attribute ``cp_mode.MODE_ATTR``: the
  sealed record accepts underscore names before, during and after resolution, and its
  ``__reduce__`` carries them to spawned schedulers. The flag stores
  :attr:`CpMode.SHARDED`; resolution settles it once (:func:`decide_mode`, one prefill
  rank: :attr:`CpMode.ONE_RANK_L3_READER`) and it never changes after.

Resolution steps (see ``v0_5_23.hooks.RESOLUTION_STEPS``):

* :func:`refuse_and_enable_sharding` wraps ``validate_prefill_cp_platform``, which runs for
  every record (the dummy-model path too) before the model is resolved or downloaded:
  every configuration refusal at once, in one message starting with the flag, then the
  sharding declaration. It must precede upstream's first reader of
  ``enable_kv_cache_sharding``, ``handle_gpu_memory_settings`` (``pipeline.py:218`` ->
  ``overrides.py:1799``), which runs long before the gate (``pipeline.py:284``).
* :func:`refuse_unsupported_model` wraps the gate itself: once the model is known, a model
  outside the DSA family is refused; then upstream's gate runs with every rule but its
  storage refusal, which the plugin's file / mooncake L3 backends lift (``docs/l3_storage.md``).

Where upstream's gate refuses the same combination (a storage backend other than file or
mooncake, HiSparse, a mode other than PD prefill, radix backend, tree core, zigzag, EAGLE
without topk 1), ours runs
first, names the flag and agrees with it, so a user never sees two verdicts, and hears it
before any model download. Ours adds what upstream lets through or refuses unclearly: no
prefill CP, ``--use-ray``, the routed-experts/indexer-topk capture, a draft off the dsa
backend, ``NEXTN`` spelled as such (upstream's gate checks the algorithm before it resolves
the alias, ``arg_groups/pipeline.py:284`` vs ``:306``) and a non-DSA model.

0.5.12 spellings. 0.5.23 renamed prefill CP to ``--enable-prefill-cp --cp-strategy
{interleave,zigzag}`` and removed ``--enable-nsa-prefill-context-parallel`` and
``--nsa-prefill-cp-mode {round-robin-split,in-seq-split}`` without an alias. With the
plugin's flag they are accepted as deprecated aliases (round-robin-split -> interleave,
in-seq-split -> zigzag, 0.5.12's default round-robin-split), with one warning per spelling:
that is how SGLang itself retires a flag (``--enable-dp-attention``, ``--disable-cuda-graph``
map to their new spelling with a warning, ``server_args.py:add_cli_args``), and it lets the
mission's launch command, which is spelled for 0.5.12, run on both lines. Without the
plugin's flag they are refused with a message naming the 0.5.23 spellings: with its flag
off the plugin widens nothing SGLang accepts.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, Callable, ContextManager, List, MutableMapping, Optional, Set

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.core.field_overlay import FieldOverlay
from sglang_cp_hicache.core.module_binding import binding_swapped
from sglang_cp_hicache.v0_5_23.launch.cp_mode import MODE_ATTR, CpMode, cp_mode
from sglang_cp_hicache.v0_5_23.hooks import PluginNotInstalledError, verify_hooks_installed

logger = logging.getLogger(__name__)

FLAG = "enable_nsa_prefill_cp_shared_kv"  # argparse dest and Engine keyword
CLI_FLAG = "--enable-nsa-prefill-cp-shared-kv"
# The source our declarations carry in the record's resolution stash.
DECLARATION_SOURCE = "sglang_cp_hicache.enable_nsa_prefill_cp_shared_kv"

LEGACY_CP_DEST = "enable_nsa_prefill_context_parallel"
LEGACY_CP_FLAG = "--enable-nsa-prefill-context-parallel"
LEGACY_MODE_DEST = "nsa_prefill_cp_mode"
LEGACY_MODE_FLAG = "--nsa-prefill-cp-mode"
#: 0.5.12's prefill-CP modes and the 0.5.23 ``--cp-strategy`` of each (``layers/cp/base.py``).
LEGACY_CP_STRATEGIES = {"round-robin-split": "interleave", "in-seq-split": "zigzag"}
LEGACY_DEFAULT_MODE = "round-robin-split"  # 0.5.12's default --nsa-prefill-cp-mode

SUPPORTED_CP_STRATEGY = "interleave"  # upstream's DSA sharding gate, kv_shard_hook.py:39
SUPPORTED_SPECULATIVE_ALGORITHM = "EAGLE"
SUPPORTED_DRAFT_BACKENDS = (None, "dsa")
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
SUPPORTED_STORAGE_BACKENDS = (None, "file", "mooncake")  # None: no L3 tier

_warned_spellings: Set[str] = set()


class CpSharedKVConfigError(ValueError):
    """An unsupported server configuration together with CP shared KV."""


def set_cp_shared_kv_enabled(server_args: Any, enabled: bool) -> None:
    """Store the flag on a record before it is resolved: the mode it asks for,
    :attr:`CpMode.SHARDED` (resolution settles it, :func:`decide_mode`), or off."""
    if (cp_mode(server_args) is not CpMode.OFF) == bool(enabled):
        return  # as asked already (a mode resolution settled stays)
    if getattr(server_args, "_resolution_finished", False):
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: this ServerArgs is already resolved, so the flag can no longer "
            "change; pass it when the record is built (command line or Engine keyword)"
        )
    setattr(server_args, MODE_ATTR, CpMode.SHARDED if enabled else CpMode.OFF)


# ------------------------------------------------------------------------ the CLI
_EnableAction = hook_table.verified_flag_action(verify_hooks_installed)


def add_cli_args_after(result: Any, parser: argparse.ArgumentParser) -> None:
    if any(CLI_FLAG in action.option_strings for action in parser._actions):
        return None
    parser.add_argument(
        CLI_FLAG,
        dest=FLAG,
        action=_EnableAction,
        help=(
            "DSA prefill context parallel with shared KV: each prefill-CP rank stores only "
            "the KV pages it owns (owner = logical page %% cp_size), multiplying KV "
            "capacity by cp_size; HiCache backs up and loads only owned pages. Turns on "
            "--enable-kv-cache-sharding. Requires --enable-prefill-cp --cp-strategy "
            "interleave on a PD prefill worker. (sglang-cp-hicache plugin)"
        ),
    )
    parser.add_argument(
        LEGACY_CP_FLAG,
        dest=LEGACY_CP_DEST,
        action="store_true",
        default=None,  # None: not given (a given flag is a deprecation to report)
        help=(
            "Deprecated 0.5.12 spelling of --enable-prefill-cp --cp-strategy interleave, "
            f"accepted only with {CLI_FLAG}. (sglang-cp-hicache plugin)"
        ),
    )
    parser.add_argument(
        LEGACY_MODE_FLAG,
        dest=LEGACY_MODE_DEST,
        choices=tuple(LEGACY_CP_STRATEGIES),
        default=None,
        help=(
            "Deprecated 0.5.12 spelling of --cp-strategy (round-robin-split: interleave, "
            f"in-seq-split: zigzag), accepted only with {CLI_FLAG}. (sglang-cp-hicache plugin)"
        ),
    )
    return None


def _warn_once(spelling: str, meaning: str) -> None:
    if spelling not in _warned_spellings:
        _warned_spellings.add(spelling)
        logger.warning(
            "%s is the SGLang 0.5.12 spelling; on SGLang 0.5.23 it means %s. Use the new "
            "spelling: the old one is accepted only with %s.",
            spelling,
            meaning,
            CLI_FLAG,
        )


def translate_legacy_spellings(values: MutableMapping[str, Any], *, cp_shared_kv: bool) -> None:
    """Rewrite 0.5.12's prefill-CP spellings in ``values`` (an argparse namespace's dict or
    Engine keywords) into 0.5.23's record fields, in place; refuse them without the flag.

    An explicit 0.5.23 ``cp_strategy`` wins over the old default; one that contradicts an
    explicit old mode is refused.
    """
    legacy_cp = values.pop(LEGACY_CP_DEST, None)
    legacy_mode = values.pop(LEGACY_MODE_DEST, None)
    if not legacy_cp and legacy_mode is None:
        return
    given = [LEGACY_CP_FLAG] if legacy_cp else []
    given += [f"{LEGACY_MODE_FLAG} {legacy_mode}"] if legacy_mode is not None else []
    if not cp_shared_kv:
        raise CpSharedKVConfigError(
            f"{' '.join(given)}: SGLang 0.5.23 removed these 0.5.12 spellings; write "
            "--enable-prefill-cp --cp-strategy interleave (round-robin-split) or "
            f"--cp-strategy zigzag (in-seq-split). The plugin accepts the old spelling only "
            f"together with {CLI_FLAG}."
        )
    if legacy_mode is not None and legacy_mode not in LEGACY_CP_STRATEGIES:
        raise CpSharedKVConfigError(
            f"{LEGACY_MODE_FLAG} {legacy_mode!r}: choose from {', '.join(LEGACY_CP_STRATEGIES)}"
        )
    strategy = LEGACY_CP_STRATEGIES[legacy_mode or LEGACY_DEFAULT_MODE]
    explicit = values.get("cp_strategy")
    if explicit is not None and legacy_mode is not None and explicit != strategy:
        raise CpSharedKVConfigError(
            f"{CLI_FLAG}: {LEGACY_MODE_FLAG} {legacy_mode} means --cp-strategy {strategy}, "
            f"which contradicts --cp-strategy {explicit}; give one of them"
        )
    if legacy_cp:
        values["enable_prefill_cp"] = True
        implied = f" --cp-strategy {strategy}" if explicit is None and legacy_mode is None else ""
        _warn_once(LEGACY_CP_FLAG, f"--enable-prefill-cp{implied}")
    if explicit is None:
        values["cp_strategy"] = strategy
    if legacy_mode is not None:
        _warn_once(f"{LEGACY_MODE_FLAG} {legacy_mode}", f"--cp-strategy {strategy}")


def from_cli_args_around(original: Callable, cls: type, args: argparse.Namespace):
    enabled = getattr(args, FLAG, False) is True
    translate_legacy_spellings(vars(args), cp_shared_kv=enabled)
    record = original(cls, args)
    if enabled:  # flag off: the record is exactly upstream's
        set_cp_shared_kv_enabled(record, True)
    return record


# --------------------------------------------------------------------- the Engine
def engine_init_around(original: Callable, engine: Any, **kwargs) -> None:
    """``Engine(enable_nsa_prefill_cp_shared_kv=True, ...)``: the keyword is no record
    field, so it is taken off here and stored on the record Engine builds."""
    enabled = bool(kwargs.pop(FLAG, False))
    if "server_args" in kwargs:  # Engine ignores every other keyword then
        if enabled:
            set_cp_shared_kv_enabled(kwargs["server_args"], True)
        return original(engine, **kwargs)
    translate_legacy_spellings(kwargs, cp_shared_kv=enabled)
    if not enabled:
        return original(engine, **kwargs)
    verify_hooks_installed(import_targets=False)
    build_record = engine.server_args_class

    def build_enabled_record(**fields: Any) -> Any:
        record = build_record(**fields)
        set_cp_shared_kv_enabled(record, True)
        return record

    # Engine.__init__ builds its record as self.server_args_class(**kwargs): shadowing the
    # class attribute on this instance marks that record before anything resolves it,
    # and leaves the rest of upstream's construction (log level, launch command) as is.
    engine.server_args_class = build_enabled_record
    try:
        return original(engine, **kwargs)
    finally:
        del engine.server_args_class


# ------------------------------------------------------------------ the refusals
def _speculative_problems(cfg: Any) -> List[str]:
    algorithm = cfg.speculative_algorithm
    if algorithm is None:
        return []
    if algorithm == "NEXTN":
        return [
            "--speculative-algorithm NEXTN: write EAGLE on SGLang 0.5.23 (the same NextN MTP "
            "draft); upstream's sharding gate checks the algorithm before it resolves the "
            "NEXTN alias and would refuse it"
        ]
    if algorithm != SUPPORTED_SPECULATIVE_ALGORITHM:
        return [
            f"supports --speculative-algorithm {SUPPORTED_SPECULATIVE_ALGORITHM} only (the "
            f"one-layer NextN MTP draft), got --speculative-algorithm {algorithm}"
        ]
    problems = []
    if cfg.speculative_eagle_topk != 1:
        problems.append(
            "with --speculative-algorithm EAGLE needs --speculative-eagle-topk 1 "
            f"(got {cfg.speculative_eagle_topk}; upstream's gate reads it before any default)"
        )
    if cfg.enable_multi_layer_eagle:
        problems.append("supports the one-layer MTP draft only, not --enable-multi-layer-eagle")
    if cfg.speculative_draft_attention_backend not in SUPPORTED_DRAFT_BACKENDS:
        problems.append(
            "needs the draft on the dsa attention backend (the shard-aware read path), got "
            f"--speculative-draft-attention-backend {cfg.speculative_draft_attention_backend}"
        )
    return problems


def _radix_problems(cfg: Any) -> List[str]:
    from sglang.srt.environ import envs

    problems = []
    if cfg.radix_cache_backend is not None:
        problems.append(
            "needs SGLang's built-in UnifiedRadixCache with its rotation-aware tree core, "
            f"not --radix-cache-backend {cfg.radix_cache_backend}"
        )
    tree_core = getattr(envs, TREE_CORE_ENV)
    if not cfg.disable_radix_cache and tree_core.is_set() and tree_core.get() != "python":
        problems.append(
            f"needs the Python UnifiedTreeCore: {TREE_CORE_ENV}={tree_core.get()!r} (unset "
            "it, or set it to python)"
        )
    return problems


def unsupported_combinations(cfg: Any) -> List[str]:
    """Every configuration reason (model aside) ``cfg`` cannot run CP shared KV, each
    naming its 0.5.23 spelling; empty when it can. ``cfg``: a record or a resolution view."""
    problems: List[str] = []
    if not cfg.enable_prefill_cp:
        problems.append(
            "needs prefill context parallelism: --enable-prefill-cp --cp-strategy interleave "
            f"(0.5.12: {LEGACY_CP_FLAG}); pages are sharded over the prefill CP group"
        )
    elif cfg.cp_strategy != SUPPORTED_CP_STRATEGY:
        problems.append(
            f"supports --cp-strategy {SUPPORTED_CP_STRATEGY} only on SGLang 0.5.23 (0.5.12: "
            f"round-robin-split), got --cp-strategy {cfg.cp_strategy}"
        )
    if cfg.disaggregation_mode != "prefill":
        problems.append(
            "serves only as a PD prefill worker (--disaggregation-mode prefill), got "
            f"--disaggregation-mode {cfg.disaggregation_mode}: decode reads every KV page each "
            "step, which a sharded rank does not hold; run decode as a separate "
            "--disaggregation-mode decode server, which receives the full KV"
        )
    if cfg.hicache_storage_backend not in SUPPORTED_STORAGE_BACKENDS:
        # file / mooncake: owner-free keys, owner writes and reads (docs/l3_storage.md).
        problems.append(
            f"supports --hicache-storage-backend file or mooncake only (got "
            f"{cfg.hicache_storage_backend}): other backends' keys and reads are not "
            "proven for pages each rank stores only where it owns them"
        )
    if cfg.enable_hisparse:
        problems.append("does not support --enable-hisparse (it assumes whole KV pages per rank)")
    if cfg.use_ray:
        problems.append(
            "does not support --use-ray: SGLang 0.5.23 builds Ray scheduler actors without "
            "loading plugins (ray/scheduler_actor.py), so the plugin's hooks would be off there"
        )
    for field, option in (
        ("enable_return_routed_experts", "--enable-return-routed-experts"),
        ("enable_return_indexer_topk", "--enable-return-indexer-topk"),
    ):
        if getattr(cfg, field):
            # Capture rows are sized by one rank's KV rows (capture_token_capacity) but
            # indexed by logical locs, which reach cp_size times that under sharding.
            problems.append(f"does not support {option}")
    problems += _radix_problems(cfg)
    problems += _speculative_problems(cfg)
    return problems


def is_single_prefill_rank(cfg: Any) -> bool:
    """Whether ``cfg`` (a record or a resolution view, before the model is resolved) asks
    for the flag's one-prefill-rank mode: ``--tp 1``, so DSA interleave prefill CP resolves
    to CP size 1 (``tp_size // attn_dp_size``, ``model_overrides/deepseek_v2.py``), with an
    L3 backend the mode serves (file, mooncake) and no explicit ``--enable-kv-cache-sharding``.
    Without L3 storage the flag would change nothing at cp 1, so it declares sharding as
    everywhere and upstream's verdict stands ("DSA KV sharding requires ... CP > 1"). The
    model step checks the resolved CP size."""
    return (
        cfg.tp_size == 1
        and cfg.hicache_storage_backend is not None
        and cfg.hicache_storage_backend in SUPPORTED_STORAGE_BACKENDS
        and not cfg.enable_kv_cache_sharding
    )


def single_rank_problems(cfg: Any) -> List[str]:
    """Why ``cfg`` cannot run the flag on one prefill rank, besides
    :func:`unsupported_combinations` (empty when it can)."""
    problems = []
    if not cfg.enable_hierarchical_cache:
        problems.append(
            "on one prefill rank (--tp 1) the flag only reads and writes the L3 pages of "
            "sharded servers (their owner-free keys), so --hicache-storage-backend "
            f"{cfg.hicache_storage_backend} needs --enable-hierarchical-cache"
        )
    if cfg.pp_size != 1:
        problems.append(
            f"on one prefill rank needs --pp-size 1 (got {cfg.pp_size}): sharded servers "
            "run PP 1 (upstream's DSA sharding rule), so a pipeline stage's pages would be "
            "another L3 namespace"
        )
    return problems


def unsupported_models(server_args: Any) -> List[str]:
    """Why the model of ``server_args`` cannot run CP shared KV (empty when it can).
    Needs the model config: call once resolution has resolved the model path."""
    from sglang.srt.arg_groups.overrides import model_config_of
    from sglang.srt.configs.model_config import is_deepseek_dsa

    hf_config = model_config_of(server_args).hf_config
    if is_deepseek_dsa(hf_config):
        return []
    architecture = (getattr(hf_config, "architectures", None) or ["<no architecture>"])[0]
    return [
        "needs a DSA sparse-attention model (GLM-5 GlmMoeDsaForCausalLM, DeepSeek-V3.2 "
        f"DeepseekV32ForCausalLM), got {architecture}; other models shard with upstream's "
        "--enable-kv-cache-sharding"
    ]


def _refuse(problems: List[str]) -> None:
    if problems:
        raise CpSharedKVConfigError(f"{CLI_FLAG}: " + "; ".join(problems))


# ------------------------------------------------- L3 storage at upstream's gate
def _storage_hidden(backend: Optional[str]) -> Optional[str]:
    """An admitted backend (file, mooncake) hidden from upstream's gate, so its storage rule
    passes; any other shows through (the plugin's own refusal, :func:`unsupported_combinations`,
    has named it already; if a later step declared one, upstream's verdict stands)."""
    return None if backend in SUPPORTED_STORAGE_BACKENDS else backend


def storage_hidden_from_gate() -> ContextManager[None]:
    """Within: upstream's gate module (``sglang.srt.arg_groups.kv_shard_hook``) reads a
    record that has the flag without an admitted L3 backend (a ``FieldOverlay`` showing
    :func:`_storage_hidden`); any other record, and any other module, through upstream's
    own ``resolving_view``. The gate builds its view by
    the module-global name ``resolving_view``; only that binding is swapped, for the
    duration of the gate (:func:`binding_swapped`)."""
    from sglang.srt.arg_groups import kv_shard_hook as gate

    def without_storage(upstream_view: Callable[[Any], Any]) -> Callable[[Any], Any]:
        def view(server_args: Any) -> Any:
            cfg = upstream_view(server_args)
            if not cp_mode(server_args).shards_kv:
                return cfg
            return FieldOverlay(cfg, {"hicache_storage_backend": _storage_hidden})

        return view

    return binding_swapped(gate, "resolving_view", without_storage)


# ------------------------------------------------------------ resolution steps
def decide_mode(requested: CpMode, cfg: Any) -> CpMode:
    """The server's mode, from the mode the record asks for (the flag's
    :attr:`CpMode.SHARDED`, or one settled by an earlier run of the step) and ``cfg`` (a
    resolution view before the model is resolved): one prefill rank
    (:func:`is_single_prefill_rank`) makes the flag a one-rank L3 reader. The one place the
    mode is decided; once settled it stays."""
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

        verify_hooks_installed(import_targets=False)
        cfg = resolving_view(server_args)
        mode = decide_mode(requested, cfg)
        problems = unsupported_combinations(cfg)
        one_rank = mode is CpMode.ONE_RANK_L3_READER
        _refuse(problems + single_rank_problems(cfg) if one_rank else problems)
        if mode is not requested:
            setattr(server_args, MODE_ATTR, mode)
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
    :func:`storage_hidden_from_gate`). One prefill rank: the model rule, the resolved CP
    size 1, then upstream's gate as is (sharding off, it checks nothing)."""
    mode = cp_mode(server_args)
    if mode is CpMode.ONE_RANK_L3_READER:
        _refuse(unsupported_models(server_args))
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
        _refuse(unsupported_models(server_args))
        with storage_hidden_from_gate():
            previous(server_args)
        return
    previous(server_args)
