"""The run's report: per-rank results of every column in, ``SimReport`` out (``build``),
its records (``records``, with the ``balance``, ``pd`` and ``storage`` summaries and a
column's checks in ``columns``) and the human-readable table (``table``)."""

from sglang_cp_hicache.sim.report.balance import LaneBalance, max_over_mean
from sglang_cp_hicache.sim.report.build import build_report
from sglang_cp_hicache.sim.report.columns import ColumnSummary
from sglang_cp_hicache.sim.report.pd import PDSummary
from sglang_cp_hicache.sim.report.records import BaselineSummary, SimReport
from sglang_cp_hicache.sim.report.storage import StorageSummary
from sglang_cp_hicache.sim.report.table import format_table

__all__ = [
    "BaselineSummary",
    "ColumnSummary",
    "LaneBalance",
    "PDSummary",
    "SimReport",
    "StorageSummary",
    "build_report",
    "format_table",
    "max_over_mean",
]
