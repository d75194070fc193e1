"""What a run reports (``SimReport``, its JSON): the main column's figures at the top
level, every column's ``ColumnSummary``, the cp-1 replay's ``BaselineSummary``, and the
lane balance, PD and L3 summaries where they ran."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

from sglang_cp_hicache.sim.report.balance import LaneBalance
from sglang_cp_hicache.sim.report.columns import ColumnSummary
from sglang_cp_hicache.sim.report.pd import PDSummary
from sglang_cp_hicache.sim.report.storage import StorageSummary


@dataclass
class BaselineSummary:
    """The same trace through upstream non-CP HiRadixCache (cp 1, same physical pool)."""

    device_hit_tokens: int
    host_hit_tokens: int
    load_backs: int
    device_evicted_tokens: int
    host_evicted_tokens: int
    hit_rate: float
    host_peak_bytes: int
    d2h_bytes: int
    h2d_bytes: int
    kv_mismatches: int
    rejected_insert_tokens: int = 0
    rejected_insert_hit_tokens: int = 0
    storage_hit_tokens: int = 0  # of host_hit_tokens, prefetched from L3 first
    storage_written_bytes: int = 0
    storage_read_bytes: int = 0



@dataclass
class SimReport:
    config: Dict[str, Any]
    requests: int
    steps: int
    prompt_tokens: int
    # ---- proofs
    kv_mismatches: int
    kv_checked_tokens: int
    invariant_violations: List[str]
    radix_digests: List[str]
    decision_hashes: List[str]
    hot_path_collectives: int
    hot_path_collectives_by_name: Dict[str, int]
    writing_check_all_reduces: List[int]
    leaked_device_slots: int
    leaked_host_slots: int
    # ---- cache behaviour (replicated, identical on every rank)
    device_hit_tokens: int
    host_hit_tokens: int
    host_matched_tokens: int
    load_backs: int
    load_back_failures: int
    hit_rate: float
    device_evictions: int
    device_evicted_tokens: int
    device_dropped_tokens: int
    host_evictions: int
    host_evicted_tokens: int
    # ---- scheduler features and the pending-backup state machine (replicated)
    prefill_chunks: int
    aborted_requests: int
    retracted_requests: int
    deferred_requests: int
    pending_committed: int
    pending_rolled_back: int
    deferred_splits: int
    backups_skipped_host_full: int
    per_layer_forwards: int  # forwards whose reserved backups went to host layer by layer
    per_layer_layers: int  # the layers they reported to the backup
    per_layer_acks: int  # the acks they appended (one per forward)
    per_layer_l3_writes: int  # L3 writes of per-layer-backed host slots, each after its ack
    # ---- memory and traffic
    bytes_per_token: int
    logical_host_bytes: int  # peak, logical (what a replicated host tier holds per rank)
    host_bytes_per_rank: List[int]  # peak, physical
    d2h_bytes_per_rank: List[int]
    h2d_bytes_per_rank: List[int]
    replicated_d2h_bytes: int  # what every rank would move without shared KV
    replicated_h2d_bytes: int
    balance: LaneBalance  # lane fill skew and per-rank byte skew
    # ---- scheduler-thread CPU time per step (prefill batch), microseconds
    op_time_us: Dict[str, Dict[str, float]]
    baseline_op_time_us: Optional[Dict[str, Dict[str, float]]]
    op_wall_us: Dict[str, Dict[str, float]]  # wall time: adds waits (all-reduce, core sharing)
    baseline: Optional[BaselineSummary]
    wall_s: float = 0.0
    series: Dict[str, Any] = field(default_factory=dict)
    # ---- the MTP draft (SimConfig.draft): its KV shares the target's host slots and every
    # hit checks it; a draft-only loss is a draft mismatch, never a good hit
    draft: bool = False
    draft_kv_mismatches: int = 0
    draft_kv_checked_tokens: int = 0
    draft_bytes_per_token: int = 0
    draft_host_bytes_per_rank: List[int] = field(default_factory=list)  # peak, physical
    draft_d2h_bytes_per_rank: List[int] = field(default_factory=list)
    draft_h2d_bytes_per_rank: List[int] = field(default_factory=list)
    # ---- the SGLang line and the comparison columns
    sglang_release: str = ""
    rejected_inserts: int = 0  # the main column's inserts refused by the tree
    rejected_insert_tokens: int = 0
    rejected_insert_hit_tokens: int = 0  # hits they cost (upper bound)
    # Every column that ran, main first ("plugin" or "native", then "native" beside a
    # plugin run where the line has it, then "upstream"): the same figures for each.
    columns: Dict[str, ColumnSummary] = field(default_factory=dict)
    native_column_note: Optional[str] = None  # why a native column was asked for and not run
    # The native column's op times beside a plugin run (same trace, same cp): what the
    # plugin's hooks cost per op, which the cp-1 upstream comparison cannot isolate.
    native_op_time_us: Optional[Dict[str, Dict[str, float]]] = None
    # ---- PD (SimConfig.pd): the main column's transfers to the decode process
    pd: bool = False
    pd_transferred_tokens: int = 0
    pd_kv_mismatches: int = 0  # decode-side, tokens (target KV/indexer or draft)
    pd_sent_bytes_per_rank: List[int] = field(default_factory=list)
    pd_summary: Optional[PDSummary] = None
    # ---- L3 storage (SimConfig.storage_backend): the main column's, and beside it the
    # cp-1 upstream column's in storage_summary (and columns["upstream"])
    storage_backend: Optional[str] = None
    storage_hit_tokens: int = 0  # of host_hit_tokens, prefetched from L3 first
    storage_written_bytes_per_rank: List[int] = field(default_factory=list)
    storage_read_bytes_per_rank: List[int] = field(default_factory=list)
    storage_summary: Optional[StorageSummary] = None

    @property
    def passed(self) -> bool:
        return (
            self.kv_mismatches == 0
            and self.pd_kv_mismatches == 0
            and self.draft_kv_mismatches == 0
            and not self.invariant_violations
            and self.hot_path_collectives == 0
            and self.leaked_device_slots == 0
            and self.leaked_host_slots == 0
            and len(set(self.radix_digests)) == 1
        )

    def to_dict(self) -> Dict[str, Any]:
        data = dataclasses.asdict(self)
        data["passed"] = self.passed
        return data

    def write_json(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as handle:
            json.dump(self.to_dict(), handle, indent=2)
            handle.write("\n")

