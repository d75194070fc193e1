"""Turns per-rank results into the report: cross-rank checks, aggregates, table, JSON."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.results import OPS, LaneUsage, PDDecodeStats, RankCounters, RankResult

if TYPE_CHECKING:
    from sglang_cp_hicache.sim.lines import Column, LineSim

_PER_RANK_FIELDS = ("kv_checked_tokens", "kv_mismatches", "draft_kv_checked_tokens", "draft_kv_mismatches")


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
class ColumnSummary:
    """One column of the comparison: one implementation's replay of the same trace, with
    every invariant checked (``passed``: its own checks, as ``SimReport.passed`` for the
    main column). Byte lists have one entry per rank of that replay."""

    name: str  # "plugin" | "native" | "upstream" (lines.COLUMNS)
    label: str
    world_size: int
    passed: bool
    violations: int
    kv_mismatches: int
    kv_checked_tokens: int
    prompt_tokens: int
    device_hit_tokens: int
    host_hit_tokens: int
    load_backs: int
    hit_rate: float
    device_evicted_tokens: int
    host_evicted_tokens: int
    rejected_inserts: int
    rejected_insert_tokens: int  # refused by the tree (rotation-run joins under sharding)
    rejected_insert_hit_tokens: int  # hits they cost (upper bound)
    device_lane_peak_skew: float  # max/mean over owner lanes; 1.0 for one rank
    host_lane_peak_skew: float
    host_bytes_per_rank: List[int]  # peak, physical
    d2h_bytes_per_rank: List[int]
    h2d_bytes_per_rank: List[int]
    hot_path_collectives: int
    leaked_slots: int  # device + req + host slots over ranks
    backups_skipped_host_full: int = 0  # backups dropped for want of host room (replicated)
    # L3 storage (SimConfig.storage_backend; empty where the column ran without it)
    storage_backend_class: str = ""
    storage_hit_tokens: int = 0  # of host_hit_tokens, prefetched from L3 first
    storage_written_bytes_per_rank: List[int] = field(default_factory=list)
    storage_read_bytes_per_rank: List[int] = field(default_factory=list)
    storage_prior_run_read_pages: int = 0  # pages read that an earlier run had stored


@dataclass
class StorageSummary:
    """The main column's L3 figures against the cp-1 upstream column's on the same trace,
    and the issue's targets (reported, not checks: every storage hit's bytes are checked
    like any host hit's, in ``kv_mismatches``)."""

    backend: str
    backend_class: str
    hit_tokens: int
    written_bytes_per_rank: List[int]
    read_bytes_per_rank: List[int]
    written_vs_logical: float  # max-rank / (bytes over ranks / cp): each page by its owner
    read_vs_logical: float
    prior_run_read_pages: int
    rejected_reads: int
    prefetches_issued: int = 0  # replicated: rank 0's
    anchor_skips: int = 0  # the plugin's prefetches not issued under a pending backup
    requeries: int = 0  # re-issued at admission after a prefix was lost in the queue
    upstream_prefetches_issued: Optional[int] = None
    upstream_hit_tokens: Optional[int] = None
    upstream_written_bytes: Optional[int] = None
    upstream_read_bytes: Optional[int] = None
    upstream_hit_tokens_total: Optional[int] = None  # upstream's device + host hits
    # The upstream_logical column (SimConfig.storage_logical_baseline): upstream cp 1 with
    # cp x the per-rank pools, the same logical L1 + L2 as the main column's lanes.
    logical_upstream_hit_tokens: Optional[int] = None
    logical_upstream_hit_tokens_total: Optional[int] = None
    logical_upstream_written_bytes: Optional[int] = None
    logical_upstream_read_bytes: Optional[int] = None
    hit_tokens_total: int = 0  # the main column's device + host hits
    native_note: Optional[str] = None  # why the native column ran without L3
    targets: Dict[str, bool] = field(default_factory=dict)


def _storage_summary(
    results: List[RankResult], upstream: Optional[List[RankResult]], native_ran: bool,
    hot_path: int, upstream_hot_path: Optional[int],
    logical: Optional[List[RankResult]] = None,
) -> Optional[StorageSummary]:  # fmt: skip
    ranks = [r.storage for r in results]
    if ranks[0] is None:
        return None
    c = results[0].counters
    written, read = [s.written_bytes for s in ranks], [s.read_bytes for s in ranks]
    summary = StorageSummary(
        backend=ranks[0].backend,
        backend_class=ranks[0].backend_class,
        hit_tokens=c.storage_hit_tokens,
        written_bytes_per_rank=written,
        read_bytes_per_rank=read,
        written_vs_logical=_vs_logical(written, sum(written)),
        read_vs_logical=_vs_logical(read, sum(read)),
        prior_run_read_pages=sum(s.prior_run_read_pages for s in ranks),
        rejected_reads=sum(s.rejected_reads for s in ranks),
        prefetches_issued=ranks[0].prefetches_issued,
        anchor_skips=ranks[0].anchor_skips,
        requeries=ranks[0].requeries,
        hit_tokens_total=c.device_hit_tokens + c.host_hit_tokens,
        native_note=_STORAGE_NATIVE_NOTE if native_ran else None,
    )
    mismatches = sum(r.counters.kv_mismatches for r in results)
    summary.targets = {
        "0 mismatches": mismatches == 0,
        "max-rank written <= 1.10x logical/cp": summary.written_vs_logical <= 1.10,
        "max-rank read <= 1.10x logical/cp": summary.read_vs_logical <= 1.10,
    }
    base = upstream[0] if upstream else None
    if base is not None and base.storage is not None:
        b = base.counters
        summary.upstream_hit_tokens = b.storage_hit_tokens
        summary.upstream_prefetches_issued = base.storage.prefetches_issued
        summary.upstream_written_bytes = base.storage.written_bytes
        summary.upstream_read_bytes = base.storage.read_bytes
        summary.upstream_hit_tokens_total = b.device_hit_tokens + b.host_hit_tokens
        summary.targets["storage hit tokens >= upstream cp 1"] = c.storage_hit_tokens >= b.storage_hit_tokens
        summary.targets["all hit tokens >= upstream cp 1"] = (
            summary.hit_tokens_total >= summary.upstream_hit_tokens_total
        )
        summary.targets["scheduler-path collectives <= upstream's"] = hot_path <= (upstream_hot_path or 0)
    same = logical[0] if logical else None
    if same is not None and same.storage is not None:
        b = same.counters
        summary.logical_upstream_hit_tokens = b.storage_hit_tokens
        summary.logical_upstream_hit_tokens_total = b.device_hit_tokens + b.host_hit_tokens
        summary.logical_upstream_written_bytes = same.storage.written_bytes
        summary.logical_upstream_read_bytes = same.storage.read_bytes
        summary.targets["storage hit tokens >= upstream cp 1, same logical L2"] = (
            c.storage_hit_tokens >= b.storage_hit_tokens
        )
        summary.targets["all hit tokens >= upstream cp 1, same logical L2"] = (
            summary.hit_tokens_total >= summary.logical_upstream_hit_tokens_total
        )
    return summary


_STORAGE_NATIVE_NOTE = (
    "native column ran without L3: upstream 0.5.23 refuses --hicache-storage-backend with "
    "--enable-kv-cache-sharding (arg_groups/kv_shard_hook.py:176-181; at runtime attach "
    "storage_attachment.py:78-84)"
)


def max_over_mean(values: Sequence[float]) -> float:
    """Skew of per-lane (per-rank) figures: max / mean, >= 1.0; 1.0 when all are equal,
    including all zero."""
    mean = sum(values) / len(values) if values else 0.0
    return max(values) / mean if mean > 0 else 1.0


@dataclass
class LaneBalance:
    """How evenly the owner lanes (lane r = rank r's physical pools) fill and move bytes.

    Lane pages are sampled after every step; ``*_peak`` is each lane's peak over the run,
    ``*_final`` the last sample (before the flush). Skews are max / mean over lanes;
    ``*_vs_logical`` divide the max rank by logical / cp_size instead of the ranks' mean.
    """

    device_lane_peak_pages: List[int]
    device_lane_final_pages: List[int]
    host_lane_peak_pages: List[int]
    host_lane_final_pages: List[int]
    device_lane_peak_skew: float
    device_lane_final_skew: float
    host_lane_peak_skew: float
    host_lane_final_skew: float
    host_peak_bytes_skew: float  # max-rank / mean peak physical host bytes
    d2h_bytes_skew: float
    h2d_bytes_skew: float
    host_peak_bytes_vs_logical: float  # max-rank peak host bytes / (logical peak / cp)
    d2h_bytes_vs_logical: float
    h2d_bytes_vs_logical: float


def _vs_logical(per_rank: Sequence[int], logical: int) -> float:
    share = logical / len(per_rank)
    return max(per_rank) / share if share > 0 else 1.0


def _lane_balance(results: List[RankResult]) -> LaneBalance:
    lanes: LaneUsage = results[0].lane_usage  # replicated: rank 0's view of every lane
    host = [r.host_peak_physical_bytes for r in results]
    d2h = [r.d2h_bytes for r in results]
    h2d = [r.h2d_bytes for r in results]
    c, bpt = results[0].counters, results[0].bytes_per_token
    return LaneBalance(
        device_lane_peak_pages=lanes.device_peak,
        device_lane_final_pages=lanes.device_final,
        host_lane_peak_pages=lanes.host_peak,
        host_lane_final_pages=lanes.host_final,
        device_lane_peak_skew=max_over_mean(lanes.device_peak),
        device_lane_final_skew=max_over_mean(lanes.device_final),
        host_lane_peak_skew=max_over_mean(lanes.host_peak),
        host_lane_final_skew=max_over_mean(lanes.host_final),
        host_peak_bytes_skew=max_over_mean(host),
        d2h_bytes_skew=max_over_mean(d2h),
        h2d_bytes_skew=max_over_mean(h2d),
        host_peak_bytes_vs_logical=_vs_logical(host, results[0].host_peak_logical_bytes),
        d2h_bytes_vs_logical=_vs_logical(d2h, c.logical_written_tokens * bpt),
        h2d_bytes_vs_logical=_vs_logical(h2d, c.logical_loaded_tokens * bpt),
    )


@dataclass
class PDSummary:
    """``SimConfig.pd``: the main column's finished prefills, sent by its ranks over Mooncake
    to one decode process (a full cp-1 pool) and checked there byte for byte."""

    transferred_requests: int
    transferred_tokens: int
    kv_mismatches: int  # decode-side tokens with wrong target KV / indexer or draft bytes
    draft_kv_mismatches: int  # of those, the MTP draft's
    aux_mismatches: int  # requests whose first token (MTP: hidden state) arrived wrong
    off_grant_pages_changed: int
    decode_leaked_tokens: int
    failed_transfers: int  # failures seen by decode plus those seen by the prefill ranks
    logical_bytes: int  # pages transferred x bytes per logical page (what cp 1 would send)
    sent_bytes_per_rank: List[int]
    sent_bytes_vs_logical: float  # max-rank / (logical / cp)
    transfer_ms: Dict[str, float]  # prefill side: last chunk sent -> CP-wide Success
    decode_transfer_ms: Dict[str, float]  # decode side: preallocated -> transferred
    engine_ms_per_request: float  # the busiest rank's time inside the engine's writes
    # Per rank, pages sent by position-page in the prompt (shared prefixes are the first):
    # where the send balance comes from.
    owned_by_position_per_rank: List[List[int]]
    problems: List[str]


def _ms_stats(seconds: Sequence[float]) -> Dict[str, float]:
    if not seconds:
        return {"p50": 0.0, "p90": 0.0, "mean": 0.0}
    ms = np.array(seconds, dtype=float) * 1000.0
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)), "mean": float(ms.mean())}


def _pd_summary(results: List[RankResult], decode: PDDecodeStats) -> PDSummary:
    """The decode side's checks and the ranks' send figures; ``problems`` fail the run."""
    ranks = [r.pd for r in results]
    first, c = ranks[0], results[0].counters
    logical = first.pages * first.page_bytes
    sent = [s.sent_bytes for s in ranks]
    failures = decode.failures + [f"rank {r.rank}: {f}" for r, s in zip(results, ranks) for f in s.failures]
    problems = [f"PD transfer failed: {f}" for f in failures[:10]]
    if decode.kv_mismatches or decode.draft_kv_mismatches:
        problems.append(
            f"PD: decode holds wrong bytes for {decode.kv_mismatches} tokens' KV/indexer and "
            f"{decode.draft_kv_mismatches} tokens' draft KV of {decode.tokens} received"
        )
    if decode.aux_mismatches:
        problems.append(f"PD: {decode.aux_mismatches} requests' first token / hidden state arrived wrong")
    if decode.off_grant_pages_changed:
        problems.append(f"PD: {decode.off_grant_pages_changed} decode pages never granted were written")
    if decode.leaked_tokens:
        problems.append(f"PD: {decode.leaked_tokens} decode KV slots not back after the releases")
    finished = c.requests - c.retracted_requests
    counts = {"finished prefills": finished, "decode": decode.requests}
    counts.update({f"rank {r.rank}": s.requests for r, s in zip(results, ranks)})
    if len(set(counts.values())) > 1:
        problems.append(f"PD: transfers do not match the finished prefills: {counts}")
    if not failures and sum(sent) != logical:
        # Every logical page is sent once, by its owner.
        problems.append(f"PD: bytes sent over ranks {sum(sent)} != logical {logical}")
    return PDSummary(
        transferred_requests=decode.requests,
        transferred_tokens=decode.tokens,
        kv_mismatches=decode.kv_mismatches + decode.draft_kv_mismatches,
        draft_kv_mismatches=decode.draft_kv_mismatches,
        aux_mismatches=decode.aux_mismatches,
        off_grant_pages_changed=decode.off_grant_pages_changed,
        decode_leaked_tokens=decode.leaked_tokens,
        failed_transfers=len(failures),
        logical_bytes=logical,
        sent_bytes_per_rank=sent,
        sent_bytes_vs_logical=_vs_logical(sent, logical),
        transfer_ms=_ms_stats([t for s in ranks for t in s.transfer_s]),
        decode_transfer_ms=_ms_stats(decode.transfer_s),
        engine_ms_per_request=max(s.engine_s for s in ranks) * 1000.0 / max(1, first.requests),
        owned_by_position_per_rank=[list(s.owned_by_position) for s in ranks],
        problems=problems,
    )


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


# ------------------------------------------------------------------ building
def _op_stats(results: List[RankResult], wall: bool = False) -> Dict[str, Dict[str, float]]:
    stats: Dict[str, Dict[str, float]] = {}
    for op in OPS:
        per_rank = [r.op_wall_samples_us if wall else r.op_samples_us for r in results]
        samples = np.array([s for samples in per_rank for s in samples.get(op, [])], dtype=float)
        if len(samples) == 0:
            stats[op] = {"count": 0, "p50": 0.0, "p99": 0.0, "mean": 0.0}
            continue
        stats[op] = {
            "count": int(len(samples)),
            "p50": float(np.percentile(samples, 50)),
            "p99": float(np.percentile(samples, 99)),
            "mean": float(samples.mean()),
        }
    return stats


def _replicated(counters: RankCounters) -> Dict[str, int]:
    return {k: v for k, v in dataclasses.asdict(counters).items() if k not in _PER_RANK_FIELDS}


def _cross_rank_checks(results: List[RankResult]) -> List[str]:
    problems: List[str] = []
    if len({r.tree_digest for r in results}) > 1:
        digests = [r.tree_digest for r in results]
        problems.append(f"radix tree digests differ across ranks: {digests}")
    if len({r.decision_hash for r in results}) > 1:
        problems.append(f"decision logs differ across ranks: {[r.decision_hash for r in results]}")
    reference = _replicated(results[0].counters)
    for r in results[1:]:
        other = _replicated(r.counters)
        diff = {k: (reference[k], other[k]) for k in reference if reference[k] != other[k]}
        if diff:
            problems.append(f"rank {r.rank} counters differ from rank 0: {diff}")
    c = results[0].counters
    hit_tokens = c.device_hit_tokens + c.host_hit_tokens
    checked = sum(r.counters.kv_checked_tokens for r in results)
    if checked != hit_tokens:
        # Every hit token has exactly one owner, which checks it.
        problems.append(f"{checked} hit tokens checked across ranks, {hit_tokens} hit")
    bpt, draft_bpt = results[0].bytes_per_token, results[0].draft_bytes_per_token
    if draft_bpt:
        draft_checked = sum(r.counters.draft_kv_checked_tokens for r in results)
        if draft_checked != hit_tokens:
            problems.append(f"{draft_checked} hit tokens' draft KV checked across ranks, {hit_tokens} hit")
    for name, per_rank, logical in (
        ("D2H", [r.d2h_bytes for r in results], c.logical_written_tokens * bpt),
        ("H2D", [r.h2d_bytes for r in results], c.logical_loaded_tokens * bpt),
        ("draft D2H", [r.draft_d2h_bytes for r in results], c.logical_written_tokens * draft_bpt),
        ("draft H2D", [r.draft_h2d_bytes for r in results], c.logical_loaded_tokens * draft_bpt),
    ):
        if sum(per_rank) != logical:
            # Each logical page moves exactly once, on its owner.
            problems.append(f"{name} bytes over ranks {sum(per_rank)} != logical {logical}")
    return problems


def _hit_rates(result: RankResult) -> List[float]:
    return [p.hit_tokens / max(1, p.prompt_tokens) for p in result.series]


def _hot_by_name(results: List[RankResult]) -> Dict[str, int]:
    hot: Dict[str, int] = {}
    for r in results:
        for name, count in r.hot_path_collectives.items():
            hot[name] = hot.get(name, 0) + count
    return hot


def _leaks(results: List[RankResult]) -> tuple:
    device = sum(abs(r.leaked_device_slots) + abs(r.leaked_req_slots) for r in results)
    return device, sum(abs(r.leaked_host_slots) for r in results)


def _column_problems(results: List[RankResult]) -> List[str]:
    """Everything ``SimReport.passed`` checks besides the ranks' own violations, as
    messages: a comparison column passes or fails on the same invariants as the main one."""
    # A rank reports each hit with wrong bytes as a violation of its own.
    problems = [v for r in results for v in r.violations] + _cross_rank_checks(results)
    hot = _hot_by_name(results)
    if hot:
        problems.append(f"collectives on the scheduler path: {hot}")
    device, host = _leaks(results)
    if device or host:
        problems.append(f"leaked device/req slots {device}, host slots {host} after the flush")
    return problems


def _lane_skews(results: List[RankResult]) -> tuple:
    lanes = results[0].lane_usage
    if lanes is None:  # one rank, one lane
        return 1.0, 1.0
    return max_over_mean(lanes.device_peak), max_over_mean(lanes.host_peak)


def _column_summary(column: "Column", results: List[RankResult], problems: List[str]) -> ColumnSummary:
    c = results[0].counters
    device_skew, host_skew = _lane_skews(results)
    device_leaks, host_leaks = _leaks(results)
    return ColumnSummary(
        name=column.name,
        label=column.label,
        world_size=len(results),
        passed=not problems,
        violations=len(problems),
        kv_mismatches=sum(r.counters.kv_mismatches for r in results),
        kv_checked_tokens=sum(r.counters.kv_checked_tokens for r in results),
        prompt_tokens=c.prompt_tokens,
        device_hit_tokens=c.device_hit_tokens,
        host_hit_tokens=c.host_hit_tokens,
        load_backs=c.load_backs,
        hit_rate=(c.device_hit_tokens + c.host_hit_tokens) / max(1, c.prompt_tokens),
        device_evicted_tokens=c.device_evicted_tokens,
        host_evicted_tokens=c.host_evicted_tokens,
        rejected_inserts=c.rejected_inserts,
        rejected_insert_tokens=c.rejected_insert_tokens,
        rejected_insert_hit_tokens=c.rejected_insert_hit_tokens,
        device_lane_peak_skew=device_skew,
        host_lane_peak_skew=host_skew,
        host_bytes_per_rank=[r.host_peak_physical_bytes for r in results],
        d2h_bytes_per_rank=[r.d2h_bytes for r in results],
        h2d_bytes_per_rank=[r.h2d_bytes for r in results],
        hot_path_collectives=sum(_hot_by_name(results).values()),
        leaked_slots=device_leaks + host_leaks,
        backups_skipped_host_full=c.backups_skipped_host_full,
        **_column_storage(results),
    )


def _column_storage(results: List[RankResult]) -> Dict[str, Any]:
    ranks = [r.storage for r in results]
    if ranks[0] is None:
        return {}
    return dict(
        storage_backend_class=ranks[0].backend_class,
        storage_hit_tokens=results[0].counters.storage_hit_tokens,
        storage_written_bytes_per_rank=[s.written_bytes for s in ranks],
        storage_read_bytes_per_rank=[s.read_bytes for s in ranks],
        storage_prior_run_read_pages=sum(s.prior_run_read_pages for s in ranks),
    )


def _column_series(results: List[RankResult]) -> Dict[str, Any]:
    return {
        "requests": [p.requests for p in results[0].series],
        "hit_rate": _hit_rates(results[0]),
        "host_physical_bytes_per_rank": [[p.host_physical_bytes for p in r.series] for r in results],
    }


def build_report(
    cfg: SimConfig,
    line: "LineSim",
    columns: List["Column"],
    results_by_column: Dict[str, List[RankResult]],
    num_requests: int,
    num_steps: int,
    wall_s: float,
    pd_decode: Optional[PDDecodeStats] = None,
) -> SimReport:
    """The report of one run: the main column (``columns[0]``) in the top-level fields,
    every column in ``columns`` (and the cp-1 replay also in ``baseline``); with
    ``pd_decode`` (``SimConfig.pd``) the main column's PD transfers, whose problems are
    violations of the run."""
    main = columns[0]
    results = results_by_column[main.name]
    violations = [v for r in results for v in r.violations] + _cross_rank_checks(results)
    pd = _pd_summary(results, pd_decode) if pd_decode is not None else None
    if pd is not None:
        violations += pd.problems
    summaries: Dict[str, ColumnSummary] = {}
    series: Dict[str, Any] = {"columns": {}}
    for column in columns:
        column_results = results_by_column[column.name]
        problems = _column_problems(column_results)
        if column is not main:
            prefixes = {"upstream": "baseline", "upstream_logical": "logical baseline"}
            prefix = prefixes.get(column.name, column.name)
            violations = violations + [f"{prefix}: {p}" for p in problems]
        summaries[column.name] = _column_summary(column, column_results, problems)
        series["columns"][column.name] = dict(label=column.label, **_column_series(column_results))
    c = results[0].counters
    bpt = results[0].bytes_per_token
    hot_by_name = _hot_by_name(results)
    leaked_device, leaked_host = _leaks(results)
    baseline_summary = None
    baseline = results_by_column.get("upstream", [None])[0]
    if baseline is not None:
        b = baseline.counters
        baseline_summary = BaselineSummary(
            device_hit_tokens=b.device_hit_tokens,
            host_hit_tokens=b.host_hit_tokens,
            load_backs=b.load_backs,
            device_evicted_tokens=b.device_evicted_tokens,
            host_evicted_tokens=b.host_evicted_tokens,
            hit_rate=(b.device_hit_tokens + b.host_hit_tokens) / max(1, b.prompt_tokens),
            host_peak_bytes=baseline.host_peak_physical_bytes,
            d2h_bytes=baseline.d2h_bytes,
            h2d_bytes=baseline.h2d_bytes,
            kv_mismatches=b.kv_mismatches,
            rejected_insert_tokens=b.rejected_insert_tokens,
            rejected_insert_hit_tokens=b.rejected_insert_hit_tokens,
            storage_hit_tokens=b.storage_hit_tokens,
            storage_written_bytes=baseline.storage.written_bytes if baseline.storage else 0,
            storage_read_bytes=baseline.storage.read_bytes if baseline.storage else 0,
        )
    series.update(
        requests=[p.requests for p in results[0].series],
        hit_rate=_hit_rates(results[0]),
        host_physical_bytes_per_rank=[[p.host_physical_bytes for p in r.series] for r in results],
        host_logical_bytes=[p.host_logical_bytes for p in results[0].series],
    )
    if baseline is not None:
        series["baseline_requests"] = [p.requests for p in baseline.series]
        series["baseline_hit_rate"] = _hit_rates(baseline)
    upstream_hot = summaries["upstream"].hot_path_collectives if "upstream" in summaries else None
    storage = _storage_summary(
        results, results_by_column.get("upstream"), "native" in summaries,
        sum(hot_by_name.values()), upstream_hot, results_by_column.get("upstream_logical"),
    )  # fmt: skip
    native_note = None
    if cfg.runs_native_column() and not line.native_sharding:
        native_note = f"SGLang {line.release} has no native KV sharding"
    return SimReport(
        # the layout that ran, also where the line's default chose it
        config=dataclasses.asdict(dataclasses.replace(cfg, mem_layout=line.resolved_mem_layout(cfg))),
        requests=num_requests,
        steps=num_steps,
        prompt_tokens=c.prompt_tokens,
        kv_mismatches=sum(r.counters.kv_mismatches for r in results),
        kv_checked_tokens=sum(r.counters.kv_checked_tokens for r in results),
        invariant_violations=violations,
        radix_digests=[r.tree_digest for r in results],
        decision_hashes=[r.decision_hash for r in results],
        hot_path_collectives=sum(hot_by_name.values()),
        hot_path_collectives_by_name=hot_by_name,
        writing_check_all_reduces=[r.allowed_collectives for r in results],
        leaked_device_slots=leaked_device,
        leaked_host_slots=leaked_host,
        device_hit_tokens=c.device_hit_tokens,
        host_hit_tokens=c.host_hit_tokens,
        host_matched_tokens=c.host_matched_tokens,
        load_backs=c.load_backs,
        load_back_failures=c.load_back_failures,
        hit_rate=(c.device_hit_tokens + c.host_hit_tokens) / max(1, c.prompt_tokens),
        device_evictions=c.device_evicted_nodes,
        device_evicted_tokens=c.device_evicted_tokens,
        device_dropped_tokens=c.device_dropped_tokens,
        host_evictions=c.host_evicted_nodes,
        host_evicted_tokens=c.host_evicted_tokens,
        prefill_chunks=c.prefill_chunks,
        aborted_requests=c.aborted_requests,
        retracted_requests=c.retracted_requests,
        deferred_requests=c.deferred_requests,
        pending_committed=c.pending_committed,
        pending_rolled_back=c.pending_rolled_back,
        deferred_splits=c.deferred_splits,
        backups_skipped_host_full=c.backups_skipped_host_full,
        per_layer_forwards=c.per_layer_forwards,
        per_layer_layers=c.per_layer_layers,
        per_layer_acks=c.per_layer_acks,
        per_layer_l3_writes=c.per_layer_l3_writes,
        bytes_per_token=bpt,
        logical_host_bytes=results[0].host_peak_logical_bytes,
        host_bytes_per_rank=[r.host_peak_physical_bytes for r in results],
        d2h_bytes_per_rank=[r.d2h_bytes for r in results],
        h2d_bytes_per_rank=[r.h2d_bytes for r in results],
        replicated_d2h_bytes=c.logical_written_tokens * bpt,
        replicated_h2d_bytes=c.logical_loaded_tokens * bpt,
        balance=_lane_balance(results),
        op_time_us=_op_stats(results),
        op_wall_us=_op_stats(results, wall=True),
        baseline_op_time_us=_op_stats([baseline]) if baseline is not None else None,
        baseline=baseline_summary,
        wall_s=wall_s,
        series=series,
        draft=bool(results[0].draft_bytes_per_token),
        draft_kv_mismatches=sum(r.counters.draft_kv_mismatches for r in results),
        draft_kv_checked_tokens=sum(r.counters.draft_kv_checked_tokens for r in results),
        draft_bytes_per_token=results[0].draft_bytes_per_token,
        draft_host_bytes_per_rank=[r.draft_host_peak_bytes for r in results],
        draft_d2h_bytes_per_rank=[r.draft_d2h_bytes for r in results],
        draft_h2d_bytes_per_rank=[r.draft_h2d_bytes for r in results],
        sglang_release=line.release,
        rejected_inserts=c.rejected_inserts,
        rejected_insert_tokens=c.rejected_insert_tokens,
        rejected_insert_hit_tokens=c.rejected_insert_hit_tokens,
        columns=summaries,
        native_column_note=native_note,
        native_op_time_us=(
            _op_stats(results_by_column["native"]) if main.name != "native" and "native" in results_by_column else None
        ),
        pd=pd is not None,
        pd_transferred_tokens=pd.transferred_tokens if pd else 0,
        pd_kv_mismatches=pd.kv_mismatches if pd else 0,
        pd_sent_bytes_per_rank=pd.sent_bytes_per_rank if pd else [],
        pd_summary=pd,
        storage_backend=cfg.storage_backend,
        storage_hit_tokens=storage.hit_tokens if storage else 0,
        storage_written_bytes_per_rank=storage.written_bytes_per_rank if storage else [],
        storage_read_bytes_per_rank=storage.read_bytes_per_rank if storage else [],
        storage_summary=storage,
    )


# --------------------------------------------------------------------- table
def _mib(nbytes: float) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


def _headline(report: SimReport) -> List[str]:
    cfg = report.config
    digests = "equal" if len(set(report.radix_digests)) == 1 else "DIFFER"
    draft = (
        f"draft_kv_mismatches={report.draft_kv_mismatches} "
        f"(checked {report.draft_kv_checked_tokens})  "
        if report.draft
        else ""
    )
    pd = f"pd_kv_mismatches={report.pd_kv_mismatches} (decode side)  " if report.pd else ""
    others = [
        f"{s.name} {'PASS' if s.passed else 'FAIL'}"
        for name, s in report.columns.items()
        if name != cfg["shard_impl"]
    ]
    return [
        f"CP HiCache simulator  SGLang {report.sglang_release}  cp_size={cfg['cp_size']}  "
        f"mem_layout={cfg['mem_layout']}  "
        f"seed={cfg['seed']}  requests={report.requests}  batches={report.steps}  "
        f"wall={report.wall_s:.1f}s",
        f"result: {'PASS' if report.passed else 'FAIL'}  ({cfg['shard_impl']} column"
        + (f"; {', '.join(others)}" if others else "")
        + ")  "
        f"kv_mismatches={report.kv_mismatches} (checked {report.kv_checked_tokens} hit tokens)  "
        f"{draft}{pd}"
        f"violations={len(report.invariant_violations)}  "
        f"hot_path_collectives={report.hot_path_collectives}  "
        f"leaked device/host slots={report.leaked_device_slots}/{report.leaked_host_slots}  "
        f"digests {digests}",
    ]


_LABEL_WIDTH, _CELL_WIDTH = 38, 17


def _table_slots(report: SimReport) -> List[tuple]:
    """(header, summary or None, cell for a column that did not run), in ``COLUMNS`` order."""
    from sglang_cp_hicache.sim.lines import COLUMNS

    cp = report.config["cp_size"]
    slots = []
    for name in COLUMNS:
        summary = report.columns.get(name)
        if summary is None and name == "upstream_logical":
            continue  # asked for by storage_logical_baseline only
        header = summary.label if summary else ("cp=1 upstream" if name == "upstream" else f"cp={cp} {name}")
        missing = "n/a" if name == "native" and report.native_column_note else "-"
        slots.append((header, summary, missing))
    return slots


def _cache_rows(report: SimReport) -> List[str]:
    """The three columns side by side (plugin, native, cp=1 upstream), then the main
    column's scheduler-feature counters."""
    slots = _table_slots(report)
    main = report.config["shard_impl"]
    lines = [f"{'':{_LABEL_WIDTH}}" + "".join(f"{h:>{_CELL_WIDTH}}" for h, _, _ in slots)]

    def row(label: str, cell: Any, main_only: bool = False) -> None:
        cells = []
        for _, summary, missing in slots:
            if summary is None or (main_only and summary.name != main):
                cells.append(missing if summary is None else "-")
            else:
                cells.append(str(cell(summary)))
        lines.append(f"{label:{_LABEL_WIDTH}}" + "".join(f"{c:>{_CELL_WIDTH}}" for c in cells))

    row("checks", lambda s: "PASS" if s.passed else f"FAIL ({s.violations})")
    row("prompt tokens", lambda s: s.prompt_tokens)
    row("device hit tokens", lambda s: s.device_hit_tokens)
    row("host hit tokens (loaded back)", lambda s: s.host_hit_tokens)
    if report.storage_summary is not None:
        row("  of which from L3 storage",
            lambda s: s.storage_hit_tokens if s.storage_backend_class else "no L3")  # fmt: skip
    row("host-hit load-backs", lambda s: s.load_backs)
    row("hit rate", lambda s: f"{s.hit_rate:.3f}")
    row("device evicted tokens", lambda s: s.device_evicted_tokens)
    row("host evicted tokens", lambda s: s.host_evicted_tokens)
    row("rejected inserts (tokens)", lambda s: f"{s.rejected_inserts} ({s.rejected_insert_tokens})")
    row("  hits they cost (upper bound)", lambda s: s.rejected_insert_hit_tokens)
    row("lane fill skew device/host (peak)",
        lambda s: f"{s.device_lane_peak_skew:.3f}/{s.host_lane_peak_skew:.3f}")  # fmt: skip
    row("device evictions (nodes)", lambda s: report.device_evictions, main_only=True)
    row("host evictions (nodes)", lambda s: report.host_evictions, main_only=True)
    row("load-back failures", lambda s: report.load_back_failures, main_only=True)
    row("chunks / aborts / retractions",
        lambda s: f"{report.prefill_chunks}/{report.aborted_requests}/{report.retracted_requests}",
        main_only=True)  # fmt: skip
    row("backups committed / rolled back",
        lambda s: f"{report.pending_committed}/{report.pending_rolled_back}", main_only=True)  # fmt: skip
    row("deferred splits (request-rounds)",
        lambda s: f"{report.deferred_splits} ({report.deferred_requests})", main_only=True)  # fmt: skip
    row("backups skipped, host full", lambda s: report.backups_skipped_host_full, main_only=True)
    row("per-layer fwds/layers/acks (0.5.23)",
        lambda s: f"{report.per_layer_forwards}/{report.per_layer_layers}/{report.per_layer_acks}",
        main_only=True)  # fmt: skip
    if report.per_layer_l3_writes:
        row("L3 writes of per-layer backups", lambda s: report.per_layer_l3_writes, main_only=True)
    row("writing_check all-reduces/rank", lambda s: report.writing_check_all_reduces[0], main_only=True)
    if report.native_column_note:
        lines.append(f"native column n/a: {report.native_column_note}")
    return lines


def _rank_rows(report: SimReport) -> List[str]:
    """Per-rank bytes of the main column against the replicated figures, then each other
    column's per-rank bytes."""
    widths = (9, 5, 16, 19, 13, 16, 13, 16)
    titles = ("column", "rank", "host peak phys", "host peak logical", "D2H", "D2H replicated",
              "H2D", "H2D replicated")  # fmt: skip

    def line(cells) -> str:
        return "".join(f"{cell:>{width}}" for cell, width in zip(cells, widths))

    main = report.config["shard_impl"]
    lines = [line(titles)]
    per_rank = zip(report.host_bytes_per_rank, report.d2h_bytes_per_rank, report.h2d_bytes_per_rank)
    for rank, (host, d2h, h2d) in enumerate(per_rank):
        lines.append(
            line(
                (main, rank, _mib(host), _mib(report.logical_host_bytes), _mib(d2h),
                 _mib(report.replicated_d2h_bytes), _mib(h2d), _mib(report.replicated_h2d_bytes))
            )  # fmt: skip
        )
    for name, summary in report.columns.items():
        if name == main:
            continue
        per_rank = zip(summary.host_bytes_per_rank, summary.d2h_bytes_per_rank, summary.h2d_bytes_per_rank)
        for rank, (host, d2h, h2d) in enumerate(per_rank):
            label = {"upstream": "base", "upstream_logical": "base x cp"}.get(name, name)
            lines.append(line((label, rank, _mib(host), "", _mib(d2h), "", _mib(h2d), "")))
    if report.draft:
        lines.append("MTP draft KV (same host slots, included in no column above): host peak / D2H / H2D")
        draft = zip(report.draft_host_bytes_per_rank, report.draft_d2h_bytes_per_rank,
                    report.draft_h2d_bytes_per_rank)  # fmt: skip
        for rank, (host, d2h, h2d) in enumerate(draft):
            lines.append(line(("draft", rank, _mib(host), "", _mib(d2h), "", _mib(h2d), "")))
    return lines


def _balance_rows(report: SimReport) -> List[str]:
    """Lane fill per lane (lane r is rank r's pools), then the skews."""
    b = report.balance

    def pair(peak: Any, final: Any) -> str:
        return f"{peak}/{final}"

    lines = [
        "owner lane fill, used pages peak/final (lane r = rank r), sampled after every batch",
        f"{'lane':>8}{'device':>16}{'host':>16}",
    ]
    lanes = zip(b.device_lane_peak_pages, b.device_lane_final_pages,
                b.host_lane_peak_pages, b.host_lane_final_pages)  # fmt: skip
    for lane, (dev_peak, dev_final, host_peak, host_final) in enumerate(lanes):
        lines.append(f"{lane:>8}{pair(dev_peak, dev_final):>16}{pair(host_peak, host_final):>16}")
    lines.append(
        f"{'max/mean':>8}"
        f"{pair(f'{b.device_lane_peak_skew:.3f}', f'{b.device_lane_final_skew:.3f}'):>16}"
        f"{pair(f'{b.host_lane_peak_skew:.3f}', f'{b.host_lane_final_skew:.3f}'):>16}"
    )
    lines.append(
        f"max-rank / mean:          host peak {b.host_peak_bytes_skew:.3f}x  "
        f"D2H {b.d2h_bytes_skew:.3f}x  H2D {b.h2d_bytes_skew:.3f}x"
    )
    lines.append(
        f"max-rank / (logical/cp):  host peak {b.host_peak_bytes_vs_logical:.3f}x  "
        f"D2H {b.d2h_bytes_vs_logical:.3f}x  H2D {b.h2d_bytes_vs_logical:.3f}x"
    )
    return lines


OpStats = Dict[str, Dict[str, float]]


def _p50_ratio(stats: Dict[str, float], other: Optional[Dict[str, float]]) -> Optional[float]:
    """``stats`` p50 over ``other``'s, or None where either did not run."""
    if other is None or other["p50"] <= 0 or stats["count"] == 0:
        return None
    return stats["p50"] / other["p50"]


def _ratio_cell(ratio: Optional[float]) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _op_table(main: str, op_time_us: OpStats, comparisons: Sequence[Tuple[str, Optional[OpStats]]]) -> List[str]:
    """The per-op table: ``main``'s p50/p99, then per ``(name, stats or None)`` comparison
    its p50/p99 and ``main``'s p50 over it. The native comparison (same trace, same cp)
    isolates the plugin's deltas; the cp-1 upstream one adds cp x the logical cache and the
    all-reduce of cp > 1 on top."""
    header = f"{'op':14}{'n':>6}{main + ' p50':>13}{'p99':>10}"
    for name, _ in comparisons:
        header += f"{name + ' p50':>14}{'p99':>10}{main + '/' + name:>17}"
    lines = [
        "scheduler-thread CPU time per batch (us), pooled over ranks; the CPU runtime's "
        "synchronous copies are included; ratios of p50",
        header,
    ]
    for op, stats in op_time_us.items():
        line = f"{op:14}{stats['count']:>6}{stats['p50']:>13.1f}{stats['p99']:>10.1f}"
        for _, other_stats in comparisons:
            other = (other_stats or {}).get(op)
            p50 = f"{other['p50']:.1f}" if other else "-"
            p99 = f"{other['p99']:.1f}" if other else "-"
            line += f"{p50:>14}{p99:>10}{_ratio_cell(_p50_ratio(stats, other)):>17}"
        lines.append(line)
    return lines


def _op_rows(report: SimReport) -> List[str]:
    main = report.config["shard_impl"]
    comparisons: List[Tuple[str, Optional[OpStats]]] = [("upstream", report.baseline_op_time_us)]
    if main != "native":
        comparisons.insert(0, ("native", report.native_op_time_us))
    return _op_table(main, report.op_time_us, comparisons)


# Per-op p50 ratios to native inside this band (either way) read as equal: the issue's
# bench target for the plugin's hooks (bench_radix_ops within 1.15x of native per op).
_OP_RATIO_BAND = 1.15


def _change(plugin: int, native: int) -> str:
    if plugin == native:
        return "same"
    pct = f", {100.0 * (plugin - native) / native:+.1f} %" if native else ""
    return f"{plugin - native:+d}{pct}"


def _delta_rows(report: SimReport) -> List[str]:
    """Where the plugin's deltas matter on this run: each delta's figure in the plugin
    and native columns of the same trace, the mechanism behind it, and whether it moved."""
    p, n = report.columns["plugin"], report.columns["native"]
    cfg = report.config
    native_ops = report.native_op_time_us or {}
    ratios = {op: _p50_ratio(stats, native_ops.get(op)) for op, stats in report.op_time_us.items()}
    beyond = [
        f"{op} {_ratio_cell(ratio)}"
        for op, ratio in ratios.items()
        if ratio is not None and not 1 / _OP_RATIO_BAND <= ratio <= _OP_RATIO_BAND
    ]
    p_hits, n_hits = p.device_hit_tokens + p.host_hit_tokens, n.device_hit_tokens + n.host_hit_tokens
    per_layer = report.per_layer_forwards > 0
    deltas = [
        ("hits", p_hits != n_hits,
         f"hit tokens {p_hits} vs {n_hits} ({_change(p_hits, n_hits)}), hit rate {p.hit_rate:.3f} vs "
         f"{n.hit_rate:.3f}: what the deltas below buy or cost"),
        ("lane-aware device eviction",
         p.device_evicted_tokens != n.device_evicted_tokens or p.device_lane_peak_skew != n.device_lane_peak_skew,
         f"device evicted tokens {p.device_evicted_tokens} vs {n.device_evicted_tokens} "
         f"({_change(p.device_evicted_tokens, n.device_evicted_tokens)}), device lane skew "
         f"{p.device_lane_peak_skew:.3f} vs {n.device_lane_peak_skew:.3f}: the plugin frees pages only on "
         "the owner lanes that are short, upstream's lane-blind walk also on lanes that were not; "
         "acts once the device pool is full"),
        ("lane-aware host room",
         p.backups_skipped_host_full != n.backups_skipped_host_full or p.host_evicted_tokens != n.host_evicted_tokens,
         f"backups skipped for want of host room {p.backups_skipped_host_full} vs "
         f"{n.backups_skipped_host_full}, host evicted tokens {p.host_evicted_tokens} vs "
         f"{n.host_evicted_tokens}: upstream's room counts tokens, not the backup's lanes, and skips "
         "a backup whose lane stays short; acts once the host pool is full"),
        ("batch-mates on one rotation run", p.rejected_inserts != n.rejected_inserts,
         f"rejected inserts {p.rejected_inserts} vs {n.rejected_inserts} (tokens {p.rejected_insert_tokens} "
         f"vs {n.rejected_insert_tokens}, hits they cost {p.rejected_insert_hit_tokens} vs "
         f"{n.rejected_insert_hit_tokens}): upstream declines a new chain's insert that joins two "
         "rotation runs, which needs two requests of one batch starting chains over one prefix"
         + (" (none at batch size 1: try --batch-size 4)" if cfg["batch_size"] == 1 else "")),
        ("per-layer D2H backup", per_layer,
         f"{'on' if per_layer else 'off'} ({report.per_layer_forwards} forwards): the plugin reserves "
         "host slots in alloc and copies each layer during the forward (not timed here), native "
         "copies all layers after it; scheduler time, not hits"
         + ("" if per_layer else "; on unless --all-layer-backup")),
        ("scheduler time", bool(beyond),
         f"ops whose p50 is beyond {_OP_RATIO_BAND}x of native's either way: "
         + (", ".join(beyond) if beyond else "none") + " (the per-op table above; one run's CPU "
         "times, noisy where cores are shared: benchmark/hicache/bench_radix_ops.py interleaves "
         "plugin and native call by call)"),
        ("L3 storage", bool(cfg["storage_backend"]),
         f"{cfg['storage_backend'] or 'off'}: upstream refuses --hicache-storage-backend under sharding, "
         "the plugin admits it (the L3 section above)" if cfg["storage_backend"]
         else "off: upstream refuses --hicache-storage-backend under sharding; see --storage-backend file "
         "and --workload l3"),
    ]
    moved = [name for name, differs, _ in deltas if differs]
    lines = [
        f"where the plugin's deltas matter: plugin vs native, same trace (workload {cfg['workload']}, "
        f"cp {cfg['cp_size']}, batch size {cfg['batch_size']}, seed {cfg['seed']})",
    ]
    lines += [f"  {name}: {text}" for name, _, text in deltas]
    lines.append(
        "  on this run they show in: " + (", ".join(moved) if moved else "nothing (plugin = native)")
        + "; other workloads and cp sizes: docs/simulator.md"
    )
    return lines


def _pd_rows(report: SimReport) -> List[str]:
    """The main column's PD transfers, as the decode process checked them."""
    pd = report.pd_summary
    t, d = pd.transfer_ms, pd.decode_transfer_ms
    sent = ", ".join(_mib(b) for b in pd.sent_bytes_per_rank)
    return [
        f"PD to one decode process over Mooncake (loopback TCP): {pd.transferred_requests} "
        f"requests, {pd.transferred_tokens} tokens; failed {pd.failed_transfers}",
        f"  decode-side checks: pd_kv_mismatches={pd.kv_mismatches} (draft {pd.draft_kv_mismatches})"
        f"  aux wrong={pd.aux_mismatches}  off-grant pages written={pd.off_grant_pages_changed}"
        f"  decode slots leaked={pd.decode_leaked_tokens}",
        f"  sent per rank: {sent}  (logical {_mib(pd.logical_bytes)}; max-rank / (logical/cp) "
        f"{pd.sent_bytes_vs_logical:.3f}x)",
        f"  per request: last chunk -> Success p50 {t['p50']:.1f} ms, p90 {t['p90']:.1f} ms; "
        f"decode prealloc -> transferred p50 {d['p50']:.1f} ms; in the engine "
        f"{pd.engine_ms_per_request:.1f} ms (busiest rank, mean)",
    ]


def _storage_rows(report: SimReport) -> List[str]:
    """The main column's L3 traffic beside the cp-1 upstream column's, and the targets."""
    st = report.storage_summary
    lines = [
        f"L3 storage: {st.backend} ({st.backend_class}); hit tokens {st.hit_tokens}"
        + (f" (upstream cp 1: {st.upstream_hit_tokens})" if st.upstream_hit_tokens is not None else "")
        + f"; pages read that an earlier run stored: {st.prior_run_read_pages}"
        + f"; rejected reads: {st.rejected_reads}",
        f"  prefetches issued {st.prefetches_issued}"
        + (f" (upstream cp 1: {st.upstream_prefetches_issued})" if st.upstream_prefetches_issued is not None else "")
        + f", not issued under a pending backup {st.anchor_skips}, re-issued at admission "
        f"{st.requeries}",
        f"  written per rank: {', '.join(_mib(b) for b in st.written_bytes_per_rank)}  "
        f"(max-rank / (logical/cp) {st.written_vs_logical:.3f}x)"
        + (f"; upstream cp 1: {_mib(st.upstream_written_bytes)}" if st.upstream_written_bytes is not None else ""),
        f"  read per rank:    {', '.join(_mib(b) for b in st.read_bytes_per_rank)}  "
        f"(max-rank / (logical/cp) {st.read_vs_logical:.3f}x)"
        + (f"; upstream cp 1: {_mib(st.upstream_read_bytes)}" if st.upstream_read_bytes is not None else ""),
        "  targets: " + ", ".join(f"{name} {'yes' if ok else 'NO'}" for name, ok in st.targets.items()),
    ]
    if st.logical_upstream_hit_tokens is not None:
        lines.insert(-1, (
            f"  same logical L1 + L2 (upstream cp 1, cp x the pools): L3 hit tokens "
            f"{st.logical_upstream_hit_tokens}, all hit tokens {st.logical_upstream_hit_tokens_total} "
            f"(plugin: {st.hit_tokens}, {st.hit_tokens_total}); written "
            f"{_mib(st.logical_upstream_written_bytes)}, read {_mib(st.logical_upstream_read_bytes)}"
        ))  # fmt: skip
    if st.native_note:
        lines.append(f"  {st.native_note}")
    return lines


def format_table(report: SimReport) -> str:
    """The human-readable report (stdout of the CLI)."""
    lines = _headline(report) + [""] + _cache_rows(report) + [""] + _rank_rows(report)
    if report.pd_summary is not None:
        lines += [""] + _pd_rows(report)
    if report.storage_summary is not None:
        lines += [""] + _storage_rows(report)
    lines += [""] + _balance_rows(report)
    lines += [""] + _op_rows(report)
    if "plugin" in report.columns and "native" in report.columns:
        lines += [""] + _delta_rows(report)
    if report.invariant_violations:
        lines += ["", "violations (first 10):"]
        lines += [f"  {v}" for v in report.invariant_violations[:10]]
    return "\n".join(line.rstrip() for line in lines)
