"""Multi-process PD disaggregation on loopback, line-agnostic (the rank bodies
live in ``testing/<line>/pd_harness``): ``roles`` (role processes, their environment and
pipes, the bootstrap server), ``cluster`` (a line's cluster run end to end), ``scenario``
(requests, plants, outcomes), ``steps`` (what either line's prefill and decode roles do
around upstream's PD path), ``engine`` (the transfer engine, bytes sent, errors logged).
The names below are the harness's surface."""

from __future__ import annotations

from sglang_cp_hicache.testing.pd.roles import (
    ALL_CP_RANKS_TRANSFER_ENV,
    BootstrapUnreachable,
    free_port,
    GO,
    LOOPBACK,
    PDCluster,
    PDEnv,
    PDPorts,
    REGISTERED,
    role_env,
    RoleChannel,
    RoleFailed,
    RoleProcess,
    serve_bootstrap,
    wait_prefill_registered,
    wait_until_serving,
)
from sglang_cp_hicache.testing.pd.cluster import (
    decode_killed_problems,
    hold_if_asked,
    PDLine,
    prefill_names,
    prefill_startup_failure,
    run_fault_cluster,
    run_pd_cluster,
    wait_registered,
)
from sglang_cp_hicache.testing.pd.scenario import (
    DecodeOutcome,
    DecodeReport,
    EvictDevice,
    PDRequest,
    PLANTS,
    PrefillOutcome,
    ScenarioSteps,
    SENTINEL_BYTE,
    SIM_PD_SMALL_TRACE,
    Step,
)
from sglang_cp_hicache.testing.pd.steps import (
    DecodeChecks,
    load_plugins,
    PrefillSteps,
)
from sglang_cp_hicache.testing.pd.engine import (
    ErrorLog,
    init_transfer_engine,
    SentBytesMeter,
)

__all__ = [
    "ALL_CP_RANKS_TRANSFER_ENV",
    "BootstrapUnreachable",
    "DecodeChecks",
    "DecodeOutcome",
    "DecodeReport",
    "ErrorLog",
    "decode_killed_problems",
    "EvictDevice",
    "GO",
    "LOOPBACK",
    "PDCluster",
    "PDEnv",
    "PDLine",
    "PDPorts",
    "PLANTS",
    "PDRequest",
    "PrefillOutcome",
    "PrefillSteps",
    "REGISTERED",
    "RoleChannel",
    "RoleFailed",
    "RoleProcess",
    "SENTINEL_BYTE",
    "SIM_PD_SMALL_TRACE",
    "ScenarioSteps",
    "SentBytesMeter",
    "Step",
    "free_port",
    "hold_if_asked",
    "init_transfer_engine",
    "load_plugins",
    "prefill_names",
    "prefill_startup_failure",
    "role_env",
    "run_fault_cluster",
    "run_pd_cluster",
    "serve_bootstrap",
    "wait_prefill_registered",
    "wait_registered",
    "wait_until_serving",
]
