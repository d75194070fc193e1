"""Launch room: what ``--enable-nsa-prefill-cp-shared-kv`` means at startup.

The flag's names and the flag stored on a record (``flag``), on the command line (``cli``,
with 0.5.12's spellings, ``legacy_spellings``) and on ``Engine(**kwargs)`` (``engine``); the
refusals (``refusals``); the mode, one frozen value per record (``cp_mode``), decided once
by the resolution steps (``resolution``), which run upstream's sharding gate with an
admitted L3 backend hidden (``gate_view``) and its DSA backend rule admitting the Hopper
formats (``dsa_backend_rule``); a PD prefill's bootstrap registration (``pd_bootstrap``).
Exports its hook specs and resolution steps by path only: importing this package imports
none of its modules.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec
from sglang_cp_hicache.v0_5_23.resolution_steps import ResolutionStep

_SERVER_ARGS = "sglang.srt.server_args:ServerArgs"
_LAUNCH = "sglang_cp_hicache.v0_5_23.launch"

HOOKS: Tuple[HookSpec, ...] = (
    # The flag on the command line. from_cli_args copies only record fields, so the parsed
    # value (and the 0.5.12 spellings) would be dropped without the AROUND.
    HookSpec(f"{_SERVER_ARGS}.add_cli_args", f"{_LAUNCH}.cli:add_cli_args_after", "AFTER"),
    HookSpec(f"{_SERVER_ARGS}.from_cli_args", f"{_LAUNCH}.cli:from_cli_args_around", "AROUND"),
    # Engine(enable_nsa_prefill_cp_shared_kv=True): ServerArgs is a msgspec struct whose
    # Python __init__ never runs, so the keyword is taken off where Engine builds the record.
    HookSpec(
        "sglang.srt.entrypoints.engine:Engine.__init__",
        f"{_LAUNCH}.engine:engine_init_around",
        "AROUND",
    ),
    # Inside upstream's sharding gate, its DSA backend rule: under the flag, the Hopper
    # formats (flashmla_sparse bf16, flashmla_kv fp8) are admitted beside trtllm; every
    # other rule of the gate stays upstream's.
    HookSpec(
        "sglang.srt.arg_groups.kv_shard_hook:validate_kv_shard_attention_backend",
        "sglang_cp_hicache.v0_5_23.launch.dsa_backend_rule:validate_dsa_backend_around",
        "AROUND",
    ),
    # PD prefill: an unreachable bootstrap server stops startup naming host:port.
    HookSpec(
        "sglang.srt.disaggregation.common.conn:CommonKVManager._register_topology_row",
        "sglang_cp_hicache.v0_5_23.launch.pd_bootstrap:register_topology_row_around",
        "AROUND",
    ),
)

RESOLUTION_STEPS: Tuple[ResolutionStep, ...] = (
    # Runs before the model is resolved (and on the dummy-model path, which returns before
    # any model step): the configuration refusals, the mode decided once, then
    # enable_kv_cache_sharding declared before its first reader (handle_gpu_memory_settings)
    # and upstream's gate.
    ResolutionStep("validate_prefill_cp_platform", f"{_LAUNCH}.resolution:refuse_and_enable_sharding"),
    # Upstream's sharding gate, once the model is known: refuse a model outside the DSA
    # family, then run the gate unchanged.
    ResolutionStep("handle_kv_cache_sharding", f"{_LAUNCH}.resolution:refuse_unsupported_model"),
)
