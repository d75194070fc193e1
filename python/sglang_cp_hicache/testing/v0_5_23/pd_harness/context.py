"""The runtime a 0.5.23 PD role publishes as a server would (the PD record, the parallel
groups over gloo) and the ``Scheduler`` stand-ins carrying exactly what upstream's PD code
reads of a scheduler."""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any, List, Optional, Set

from sglang_cp_hicache.testing.pd.roles import LOOPBACK
from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import PAGE_SIZE
from sglang_cp_hicache.testing.v0_5_23.stack import publish_server_args


# ------------------------------------------------------------------ runtime context
def publish_pd_record(mode: str, bootstrap_port: int, config: Any = None) -> Any:
    """Publish the ``ServerArgs`` a PD server of ``mode`` runs with: prefill, the sharded
    stack's record (``config``, a ``StackConfig``) plus the PD fields, and the plugin's flag
    where the stack has it (``config.cp_shared_kv``; off: upstream's native sharding alone);
    decode, a plain cp-1 record."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    pd_fields = dict(
        host=LOOPBACK,
        disaggregation_mode=mode,
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=bootstrap_port,
    )
    if mode == "prefill":
        return publish_server_args(config, True, enable_prefill_cp=True, cp_strategy="interleave", **pd_fields)
    server_args = ServerArgs(model_path="dummy", page_size=PAGE_SIZE, **pd_fields)
    set_global_server_args_for_scheduler(server_args)
    return server_args


def stamp_parallel(cp_size: int, cp_rank: int, cp_group: Any, tp_group: Any) -> None:
    """The parallel state of a prefill CP rank (attention TP 1, CP ``cp_size``, PP 1) or,
    with ``cp_size`` 1, of the decode server; groups are gloo (``cpu_group``)."""
    from sglang.srt.runtime_context import get_parallel

    from sglang_cp_hicache.testing.v0_5_23.shard_group import GlooShardGroup

    def group(pg: Any, size: int, rank: int) -> GlooShardGroup:
        return GlooShardGroup(world_size=size, rank_in_group=rank, cpu_group=pg)

    values = dict(
        tp_size=cp_size, tp_rank=cp_rank, moe_tp_size=cp_size, attn_tp_size=1, attn_tp_rank=0,
        attn_tp_group=group(tp_group, 1, 0), pp_size=1, pp_rank=0, pp_group=group(tp_group, 1, 0),
        attn_dp_size=1, attn_dp_rank=0, dp_rank=0,
    )  # fmt: skip
    values.update(attn_cp_size=cp_size, attn_cp_rank=cp_rank, attn_cp_group=group(cp_group, cp_size, cp_rank))
    get_parallel().override_permanently(**values)


# ------------------------------------------------------------------ scheduler stand-ins
@dataclass
class PrefillSchedulerFields:
    """What upstream's ``PrefillBootstrapQueue`` and prefill mixin (``send_kv_chunk``) read
    of the ``Scheduler``."""

    server_args: Any
    tree_cache: Any
    req_to_token_pool: Any
    token_to_kv_pool_allocator: Any
    attn_cp_cpu_group: Any
    attn_tp_cpu_group: Any
    disagg_metadata_buffers: Any
    req_to_metadata_buffer_idx_allocator: Any
    model_config: Any
    tp_worker: Any
    kv_shard_widening: int
    rust_server: Any = None
    enable_staging: bool = False
    enable_overlap: bool = False
    kv_checksum_computer: Any = None
    processed_tokens_counter: int = 0
    disagg_prefill_bootstrap_queue: Any = None
    disagg_prefill_pending_chunk_rids: Set[str] = field(default_factory=set)
    output_streamer: Any = field(default_factory=lambda: SimpleNamespace(stream_output=lambda *a, **k: None))

    def retire_unadmitted_request(self, req: Any) -> None:
        raise RuntimeError(f"prefill: {req.rid} rejected at intake")

    def handle_bootstrap_failure(self, req: Any) -> None:
        """The scheduler's reaction to a Failed bootstrap poll: the request ends aborted
        (the harness frees what it holds and reads the reason)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        try:
            req.disagg_kv_sender.failure_exception()
            reason = "bootstrap failed"
        except Exception as error:  # upstream raises the recorded reason
            reason = str(error)
        req.finished_reason = FINISH_ABORT(reason)


@dataclass
class DecodeSchedulerFields:
    """What upstream's ``DecodePreallocQueue`` / ``DecodeTransferQueue`` read of the ``Scheduler``."""

    server_args: Any
    model_config: Any
    spec_algorithm: Any
    tp_worker: Any
    running_batch: Any = field(default_factory=lambda: SimpleNamespace(reqs=[]))
    waiting_queue: List[Any] = field(default_factory=list)
    last_batch: Any = None
    enable_hisparse: bool = False
    enable_decode_hicache: bool = False
    enable_priority_scheduling: bool = False
    enable_lora: bool = False
    hisparse_coordinator: Any = None
    kv_checksum_computer: Any = None
    random_seed: int = 0
    sliding_window_size: Optional[int] = None
    disagg_decode_prealloc_queue: Any = None
    metrics_reporter: Any = field(default_factory=lambda: SimpleNamespace(enable_metrics=False))
    metrics_collector: Any = None
    output_streamer: Any = field(default_factory=lambda: SimpleNamespace(stream_output=lambda *a, **k: None))
    # The handoff token's reasoning accounting (no reasoning parser here).
    batch_result_processor: Any = field(
        default_factory=lambda: SimpleNamespace(_maybe_update_reasoning_tokens=lambda *a: None)
    )

    def retire_unadmitted_request(self, req: Any) -> None:
        raise RuntimeError(f"decode: {req.rid} rejected at intake")


def dsa_model_config(layer_num: int) -> Any:
    return SimpleNamespace(
        num_hidden_layers=layer_num,
        hf_text_config=SimpleNamespace(),
        get_total_num_kv_heads=lambda: 1,
    )


__all__ = [
    "DecodeSchedulerFields",
    "dsa_model_config",
    "PrefillSchedulerFields",
    "publish_pd_record",
    "stamp_parallel",
]
