"""How evenly a run's owner lanes fill and its ranks move bytes: ``LaneBalance`` from the
ranks' results, and the two skews every summary uses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence

from sglang_cp_hicache.sim.results import LaneUsage, RankResult


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
    ``*vs_logical`` divide the max rank by logical / cp_size instead of the ranks' mean.
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


def vs_logical(per_rank: Sequence[int], logical: int) -> float:
    share = logical / len(per_rank)
    return max(per_rank) / share if share > 0 else 1.0


def lane_balance(results: List[RankResult]) -> LaneBalance:
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
        host_peak_bytes_vs_logical=vs_logical(host, results[0].host_peak_logical_bytes),
        d2h_bytes_vs_logical=vs_logical(d2h, c.logical_written_tokens * bpt),
        h2d_bytes_vs_logical=vs_logical(h2d, c.logical_loaded_tokens * bpt),
    )
