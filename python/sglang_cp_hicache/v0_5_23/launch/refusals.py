"""What ``--enable-nsa-prefill-cp-shared-kv`` refuses on SGLang 0.5.23, every reason at once.

Where upstream's gate refuses the same combination (a storage backend other than file or
mooncake, HiSparse, a mode other than PD prefill, radix backend, tree core, zigzag, EAGLE
without topk 1), ours runs first (``resolution.py``), names the flag and agrees with it, so
a user never sees two verdicts, and hears it before any model download. Ours adds what
upstream lets through or refuses unclearly: no prefill CP, ``--use-ray``, the
routed-experts/indexer-topk capture, a draft off the dsa backend, ``NEXTN`` spelled as such
(upstream's gate checks the algorithm before it resolves the alias,
``arg_groups/pipeline.py:284`` vs ``:306``) and a non-DSA model. A runtime L3 attach is
refused with the same words (``storage/runtime_attach.py``).

Each function reads a record or a resolution view (``cfg``) and returns its problems, each
naming its 0.5.23 spelling; :func:`refuse` raises them as one message starting with the flag.
"""

from __future__ import annotations

from typing import Any, List

from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG, CpSharedKVConfigError
from sglang_cp_hicache.v0_5_23.launch.legacy_spellings import LEGACY_CP_FLAG

SUPPORTED_CP_STRATEGY = "interleave"  # upstream's DSA sharding gate, kv_shard_hook.py:39
SUPPORTED_SPECULATIVE_ALGORITHM = "EAGLE"
SUPPORTED_DRAFT_BACKENDS = (None, "dsa")
TREE_CORE_ENV = "SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"
SUPPORTED_STORAGE_BACKENDS = (None, "file", "mooncake")  # None: no L3 tier


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


def _parallel_problems(cfg: Any) -> List[str]:
    problems = []
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
    return problems


def _feature_problems(cfg: Any) -> List[str]:
    problems = []
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
    return problems


def unsupported_combinations(cfg: Any) -> List[str]:
    """Every configuration reason (model aside) ``cfg`` cannot run CP shared KV, each
    naming its 0.5.23 spelling; empty when it can. ``cfg``: a record or a resolution view."""
    return (
        _parallel_problems(cfg)
        + _feature_problems(cfg)
        + _radix_problems(cfg)
        + _speculative_problems(cfg)
    )


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


def refuse(problems: List[str]) -> None:
    """Raise ``problems`` (if any) as one :class:`CpSharedKVConfigError` naming the flag."""
    if problems:
        raise CpSharedKVConfigError(f"{CLI_FLAG}: " + "; ".join(problems))


__all__ = [
    "SUPPORTED_CP_STRATEGY",
    "SUPPORTED_DRAFT_BACKENDS",
    "SUPPORTED_SPECULATIVE_ALGORITHM",
    "SUPPORTED_STORAGE_BACKENDS",
    "TREE_CORE_ENV",
    "is_single_prefill_rank",
    "refuse",
    "single_rank_problems",
    "unsupported_combinations",
    "unsupported_models",
]
