"""The ``--enable-nsa-prefill-cp-shared-kv`` flag: CLI, ``Engine(**kw)``, pickling, validation.

Extends ``sglang.srt.server_args.ServerArgs`` through hooks (no class replacement):

* ``add_cli_args`` (AFTER) adds the option; parsing it verifies the plugin's hooks (parse-time
  check, see :class:`_EnableAction`);
* ``from_cli_args`` (AROUND) carries the parsed value into ``__init__``, which copies only
  dataclass fields;
* ``__init__`` (AROUND) accepts the keyword and stores it as an instance attribute before the
  dataclass ``__init__`` runs, so ``__post_init__`` and pickling (spawned schedulers) see it;
* ``__post_init__`` (AFTER) rejects every unsupported combination with one clear message;
* ``check_server_args`` (AFTER, in :mod:`sglang_cp_hicache.v0_5_12.launch_check`) stops a real launch
  in an unsupported serving mode (the read path itself is proven per rank at init by the
  startup self-test).
"""

from __future__ import annotations

import argparse
import contextvars
import os
from typing import Any, Callable, List

from sglang_cp_hicache import hook_table
from sglang_cp_hicache.v0_5_12.hooks import verify_hooks_installed
from sglang_cp_hicache.v0_5_12.mem_cache.cp_layer_backup import per_layer_backup_problem

FLAG = "enable_nsa_prefill_cp_shared_kv"
CLI_FLAG = "--enable-nsa-prefill-cp-shared-kv"
# Which collective materialises prefix KV per layer (layers/attention/cp_shared_kv_collectives).
MATERIALIZE_DEST = "nsa_prefill_cp_shared_kv_materialize"
MATERIALIZE_FLAG = "--nsa-prefill-cp-shared-kv-materialize"
MATERIALIZE_CHOICES = ("auto", "all_gather", "all_reduce")

# from_cli_args -> __init__ carrier; a context variable keeps concurrent parsers apart.
_cli_values: contextvars.ContextVar[dict] = contextvars.ContextVar(
    "cp_shared_kv_cli_values", default={}
)


class CpSharedKVConfigError(ValueError):
    """An unsupported server configuration together with CP shared KV."""


def is_cp_shared_kv_enabled(server_args: Any) -> bool:
    """True when ``server_args`` asks for CP shared KV: its flag is the bool ``True`` (what
    ``init_around`` stores). Missing, or any other value, is off: an object that answers
    every name (a ``MagicMock`` of upstream's tests) never turns the plugin on."""
    return getattr(server_args, FLAG, False) is True


_EnableAction = hook_table.verified_flag_action(verify_hooks_installed)


def add_cli_args_after(result: Any, parser: argparse.ArgumentParser) -> None:
    if any(CLI_FLAG in action.option_strings for action in parser._actions):
        return None
    parser.add_argument(
        MATERIALIZE_FLAG,
        dest=MATERIALIZE_DEST,
        choices=MATERIALIZE_CHOICES,
        default="auto",
        help=(
            "CP shared KV: collective that materialises prefix KV per layer (auto: all_gather "
            "on NCCL, about half the bytes of all_reduce; all_reduce on gloo). "
            "(sglang-cp-hicache plugin)"
        ),
    )
    parser.add_argument(
        CLI_FLAG,
        dest=FLAG,
        action=_EnableAction,
        help=(
            "NSA prefill context parallel: each CP rank stores only the KV pages it owns "
            "(owner = logical page %% cp_size), multiplying KV capacity by cp_size; HiCache "
            "backs up and loads only owned shards. Requires "
            "--enable-nsa-prefill-context-parallel. (sglang-cp-hicache plugin)"
        ),
    )
    return None


def parsed_plugin_values(args: argparse.Namespace) -> dict:
    """The plugin's options as argparse stores them (the flag ``True``, the collective a
    string); a namespace without them, or one that answers every name, carries none."""
    values: dict = {}
    if getattr(args, FLAG, False) is True:
        values[FLAG] = True
    materialize = getattr(args, MATERIALIZE_DEST, None)
    if isinstance(materialize, str):
        values[MATERIALIZE_DEST] = materialize
    return values


def from_cli_args_around(original: Callable, cls: type, args: argparse.Namespace):
    token = _cli_values.set(parsed_plugin_values(args))
    try:
        return original(cls, args)
    finally:
        _cli_values.reset(token)


def init_around(original: Callable, self: Any, *args, **kwargs) -> None:
    parsed = _cli_values.get()
    enabled = kwargs.pop(FLAG, None)
    if enabled is None:
        enabled = parsed.get(FLAG, False)
    elif enabled:
        verify_hooks_installed(import_targets=False)
    materialize = kwargs.pop(MATERIALIZE_DEST, None) or parsed.get(MATERIALIZE_DEST, "auto")
    if materialize not in MATERIALIZE_CHOICES:
        raise CpSharedKVConfigError(
            f"{MATERIALIZE_FLAG} {materialize!r}: choose from {', '.join(MATERIALIZE_CHOICES)}"
        )
    # Set before the dataclass __init__ so __post_init__ (and its hooks) can read them.
    setattr(self, FLAG, bool(enabled))
    setattr(self, MATERIALIZE_DEST, materialize)
    original(self, *args, **kwargs)


def unsupported_cache_combinations(server_args: Any) -> List[str]:
    """The reasons the HiCache tier over owned shards cannot run with ``server_args``
    (checked again where the cache is built: a runtime-built cache has no CLI pass)."""
    problems: List[str] = []
    if getattr(server_args, "hicache_storage_backend", None) is not None:
        problems.append(
            f"{CLI_FLAG} does not support --hicache-storage-backend "
            f"(got {server_args.hicache_storage_backend!r}): storage keys assume full, "
            "contiguous host pages, not CP-owned shards"
        )
    if getattr(server_args, "enable_hisparse", False):
        problems.append(f"{CLI_FLAG} does not support --enable-hisparse")
    if getattr(server_args, "enable_hierarchical_cache", False):
        # Backups go to the host layer by layer during the forward; no slow stand-in.
        io_backend = getattr(server_args, "hicache_io_backend", "kernel")
        layout = getattr(server_args, "hicache_mem_layout", "layer_first")
        problem = per_layer_backup_problem(io_backend, layout)
        if problem is not None:
            problems.append(
                f"{CLI_FLAG} with --enable-hierarchical-cache backs up KV per layer, which "
                f"needs a per-layer device->host transfer; {problem}. Use "
                "--hicache-mem-layout layer_first (any io backend) or "
                "--hicache-io-backend direct with page_first_direct"
            )
    # Speculative decoding with HiCache: the NSA MTP draft's KV is kept on host with the
    # target's as one object (CpHiRadixCache, with the draft pool the scheduler hook hands
    # over; upstream's MLA-only Scheduler._maybe_register_hicache_draft is replaced). What
    # it cannot keep (another algorithm, multi-layer EAGLE, a non-NSA draft backend) is
    # refused by unsupported_speculative_combinations, a non-NSA draft pool where it is built.
    return problems


# Both name the MTP draft (SGLang resolves NEXTN to EAGLE, _resolve_speculative_algorithm_alias).
SUPPORTED_SPECULATIVE_ALGORITHMS = ("NEXTN", "EAGLE")


def unsupported_speculative_combinations(server_args: Any) -> List[str]:
    """Why speculative decoding in ``server_args`` cannot run with CP shared KV (empty when
    it can): only the NSA MTP draft (NextN / EAGLE, one draft layer) shares the target's
    logical locs and layout; whether the draft *is* NSA is checked where its pool is built.
    With HiCache, the draft's host KV is kept with the target's (``CpHiRadixCache``)."""
    algorithm = getattr(server_args, "speculative_algorithm", None)
    if not algorithm:
        return []
    problems: List[str] = []
    if str(algorithm).upper() not in SUPPORTED_SPECULATIVE_ALGORITHMS:
        problems.append(
            f"{CLI_FLAG} supports --speculative-algorithm "
            f"{' or '.join(SUPPORTED_SPECULATIVE_ALGORITHMS)} with an NSA draft (the "
            f"DeepSeek-V3.2 / GLM-5 MTP layer), got {algorithm}"
        )
    elif getattr(server_args, "enable_multi_layer_eagle", False):
        problems.append(
            f"{CLI_FLAG} supports the one-layer NSA MTP draft only, not multi-layer EAGLE "
            "(--enable-multi-layer-eagle)"
        )
    draft_backend = getattr(server_args, "speculative_draft_attention_backend", None)
    if draft_backend not in (None, "nsa"):
        # Only the NSA backend is wrapped by the shared-KV read path; another backend would
        # read logical locs from the draft's physical pool.
        problems.append(
            f"{CLI_FLAG} needs the draft on the NSA attention backend, got "
            f"--speculative-draft-attention-backend {draft_backend}"
        )
    return problems


def unsupported_combinations(server_args: Any) -> List[str]:
    """Every reason ``server_args`` cannot run with CP shared KV (empty when it can)."""
    problems: List[str] = []
    if not getattr(server_args, "enable_nsa_prefill_context_parallel", False):
        problems.append(
            f"{CLI_FLAG} requires --enable-nsa-prefill-context-parallel "
            "(shared KV shards pages over the NSA prefill CP group)"
        )
    problems += unsupported_cache_combinations(server_args)
    if getattr(server_args, "disaggregation_mode", "null") == "decode":
        problems.append(
            f"{CLI_FLAG} does not support --disaggregation-mode decode: the decode side "
            "receives full KV and must not shard it"
        )
    for field, cli in (
        ("enable_return_routed_experts", "--enable-return-routed-experts"),
        ("enable_return_indexer_topk", "--enable-return-indexer-topk"),
    ):
        if getattr(server_args, field, False):
            # Their capture buffers are sized by KV capacity + one page and indexed by
            # loc; logical locs reach capacity + cp_size pages (cp reserved pad pages).
            problems.append(f"{CLI_FLAG} does not support {cli}")
    if getattr(server_args, "use_ray", False):
        problems.append(
            f"{CLI_FLAG} does not support --use-ray: SGLang does not load plugins in Ray "
            "scheduler actors, so shared KV would silently be off there"
        )
    problems += unsupported_speculative_combinations(server_args)
    if getattr(server_args, "enable_hierarchical_cache", False):
        for env in ("SGLANG_ENABLE_UNIFIED_RADIX_TREE", "SGLANG_EXPERIMENTAL_CPP_RADIX_TREE"):
            if os.environ.get(env, "").lower() in ("1", "true", "yes", "on"):
                problems.append(
                    f"{CLI_FLAG} with --enable-hierarchical-cache requires HiRadixCache; "
                    f"unset {env}"
                )
    return problems


def validate_cp_shared_kv_args(server_args: Any) -> None:
    """Raise :class:`CpSharedKVConfigError` naming the first offending flag, if any."""
    if not is_cp_shared_kv_enabled(server_args):
        return
    problems = unsupported_combinations(server_args)
    if problems:
        raise CpSharedKVConfigError(problems[0])


def post_init_after(result: Any, self: Any) -> None:
    validate_cp_shared_kv_args(self)
    return None

