"""``SimConfig.storage_backend``: the main column's L3 figures against the cp-1 upstream
columns' on the same trace, and the issue's targets (``StorageSummary``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional

from sglang_cp_hicache.sim.report.balance import vs_logical
from sglang_cp_hicache.sim.results import RankResult


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


_STORAGE_NATIVE_NOTE = (
    "native column ran without L3: upstream 0.5.23 refuses --hicache-storage-backend with "
    "--enable-kv-cache-sharding (arg_groups/kv_shard_hook.py:176-181; at runtime attach "
    "storage_attachment.py:78-84)"
)


def storage_summary(
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
        written_vs_logical=vs_logical(written, sum(written)),
        read_vs_logical=vs_logical(read, sum(read)),
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
