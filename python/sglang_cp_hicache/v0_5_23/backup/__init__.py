"""Backup room: per-layer D2H backup under the flag. ``layer_backup`` decides (host slots
reserved before the forward, each layer's owned pages submitted after its store, one ack
per forward on every rank); ``l2_transfer`` moves the bytes through upstream's L2 path and
the host pools' one-layer ops. Exports its hook specs by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

_BACKUP = "sglang_cp_hicache.v0_5_23.backup.layer_backup"
_URC = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache"
_POOL = "sglang.srt.mem_cache.page_interleave_pool:PageInterleaveMLATokenToKVPool"

HOOKS: Tuple[HookSpec, ...] = (
    # The insert takes the reserved host slots; the ticket's ack finishes the node.
    HookSpec(f"{_URC}._execute_kv_backup", f"{_BACKUP}:execute_kv_backup_around", "AROUND"),
    HookSpec(
        f"{_URC}._track_write_through_node", f"{_BACKUP}:track_write_through_node_after", "AFTER"
    ),
    HookSpec(
        f"{_URC}._finish_write_through_ack", f"{_BACKUP}:finish_write_through_ack_around", "AROUND"
    ),
    HookSpec(f"{_URC}.checkpoint", f"{_BACKUP}:settle_after", "AFTER"),
    HookSpec(f"{_URC}.on_release", f"{_BACKUP}:settle_after", "AFTER"),
    HookSpec(f"{_URC}.reset", f"{_BACKUP}:reset_after", "AFTER"),
    # Each layer's KV store on the sharded pool (runs on every rank, zero-owned too).
    HookSpec(f"{_POOL}.set_mla_kv_buffer", f"{_BACKUP}:store_kv_after", "AFTER"),
    HookSpec(f"{_POOL}.set_kv_buffer", f"{_BACKUP}:store_kv_after", "AFTER"),
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner.forward",
        f"{_BACKUP}:model_forward_around",
        "AROUND",
    ),
    # Host slots reserved before an extend forward.
    HookSpec(
        "sglang.srt.managers.scheduler:Scheduler.run_batch", f"{_BACKUP}:run_batch_around", "AROUND"
    ),
    # The plugin's per-layer latency series, from each per-layer ack upstream pops.
    HookSpec(
        f"{_URC}._log_write_ack_metrics",
        "sglang_cp_hicache.v0_5_23.backup.l2_transfer:log_write_ack_metrics_after",
        "AFTER",
    ),
)
