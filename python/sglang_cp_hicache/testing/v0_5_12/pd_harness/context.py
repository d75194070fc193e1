"""SGLang 0.5.12.post1's stand-ins a PD role needs: the parallel-state groups' shapes (the
collectives run on the real gloo groups), the PD server args, and the ``Scheduler`` objects
carrying exactly the fields upstream's PD queues read."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, List, Optional

from sglang_cp_hicache.testing.pd.roles import LOOPBACK
from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import PAGE_SIZE


# ------------------------------------------------------------------ SGLang stand-ins
@dataclass(frozen=True)
class GroupShape:
    """What SGLang's PD managers read of a ``GroupCoordinator`` (size and rank): the real
    coordinator builds device communicators; the PD collectives use the gloo groups."""

    world_size: int
    rank_in_group: int


def install_parallel_state(cp_size: int, cp_rank: int) -> None:
    """SGLang's parallel state of an NSA prefill CP rank (attention TP 1, CP ``cp_size``,
    attention DP 1, PP 1), or of the decode server with ``cp_size`` 1."""
    from sglang.srt.distributed import parallel_state
    from sglang.srt.layers import dp_attention

    parallel_state._ATTN_TP = GroupShape(1, 0)
    parallel_state._ATTN_CP = GroupShape(cp_size, cp_rank)
    parallel_state._PP = GroupShape(1, 0)
    dp_attention._ATTN_DP_SIZE, dp_attention._ATTN_DP_RANK = 1, 0


def pd_server_args(mode: str, cp_size: int, bootstrap_port: int, draft: bool):
    """The ``ServerArgs`` a PD server of ``mode`` launches with (prefill: the plugin's flag
    on, NSA prefill CP as SGLang lays it out: tp = cp, dp attention, dp 1)."""
    from sglang.srt.server_args import ServerArgs

    common = dict(
        model_path="dummy",
        host=LOOPBACK,
        page_size=PAGE_SIZE,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
        speculative_algorithm="NEXTN" if draft else None,
    )
    if mode == "decode":
        return ServerArgs(**common)
    return ServerArgs(
        **common,
        tp_size=cp_size,
        dp_size=1,
        enable_dp_attention=True,
        enable_nsa_prefill_context_parallel=True,
        attn_cp_size=cp_size,
        enable_nsa_prefill_cp_shared_kv=True,
        enable_hierarchical_cache=True,
    )


@dataclass
class PrefillSchedulerFields:
    """The ``Scheduler`` fields upstream's ``PrefillBootstrapQueue`` and prefill mixin
    (``send_kv_chunk``) read."""

    server_args: Any
    tree_cache: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    attn_cp_cpu_group: Any
    attn_tp_cpu_group: Any
    disagg_metadata_buffers: Any
    model_config: Any
    tp_worker: Any = field(default_factory=lambda: SimpleNamespace(is_hybrid_swa=False))
    dp_rank: Optional[int] = None
    gpu_id: int = 0
    enable_metrics: bool = False
    enable_hicache_storage: bool = False
    sliding_window_size: Optional[int] = None
    disagg_prefill_bootstrap_queue: Any = None

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        """To the client: the harness reads each request's outcome from the request."""


@dataclass
class DecodeSchedulerFields:
    """The ``Scheduler`` fields upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` read."""

    server_args: Any
    model_config: Any
    spec_algorithm: Any
    running_batch: Any = field(default_factory=lambda: SimpleNamespace(reqs=[]))
    waiting_queue: List[Any] = field(default_factory=list)
    last_batch: Any = None
    tp_worker: Any = field(default_factory=lambda: SimpleNamespace(is_hybrid_swa=False))
    dp_rank: Optional[int] = None
    gpu_id: int = 0
    enable_hisparse: bool = False
    enable_metrics: bool = False
    enable_priority_scheduling: bool = False
    sliding_window_size: Optional[int] = None

    def stream_output(self, reqs, return_logprob=False, *args, **kwargs) -> None:
        """To the client: the harness reads each request's outcome from the request."""


__all__ = [
    "DecodeSchedulerFields",
    "GroupShape",
    "install_parallel_state",
    "pd_server_args",
    "PrefillSchedulerFields",
]
