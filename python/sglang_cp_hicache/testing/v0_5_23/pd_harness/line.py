"""This line's roles for the line-agnostic cluster runners of ``testing.pd.cluster``
(``run_pd_cluster``, ``run_fault_cluster``, ``prefill_startup_failure``)."""

from __future__ import annotations

from sglang_cp_hicache.testing.pd.cluster import PDLine
from sglang_cp_hicache.testing.v0_5_23.pd_harness.decode import decode_role
from sglang_cp_hicache.testing.v0_5_23.pd_harness.prefill import prefill_rank_role

LINE = PDLine(prefill_role=prefill_rank_role, decode_role=decode_role)
