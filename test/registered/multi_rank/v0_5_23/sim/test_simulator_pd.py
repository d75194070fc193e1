"""The simulator with PD on the 0.5.23 line (``SimConfig.pd``): every finished prefill of the
main column (upstream's sharded stack, the plugin's flag on) goes from its CP ranks through
upstream's own sharded PD send over a real Mooncake engine (loopback TCP) to one decode
process with a full pool, and is checked there byte for byte against what the simulator's
forward stored (``sim/pd.py``, ``sim/v0_5_23/pd.py``).

Both sides of a transfer report Success even when the bytes are wrong, so the planted wrong
owner below must fail the run on the decode side's check alone.
"""

from __future__ import annotations

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.simulation import run_simulation
from sglang_cp_hicache.testing.pd.scenario import SIM_PD_SMALL_TRACE

SMALL = SIM_PD_SMALL_TRACE


def test_every_finished_prefill_is_transferred_and_checked_on_decode() -> None:
    report = run_simulation(SimConfig(**SMALL))
    pd = report.pd_summary
    assert report.invariant_violations == [] and report.passed
    # The trace covered device hits, host load-backs, chunked prefills and a retraction.
    assert report.device_hit_tokens > 0 and report.host_hit_tokens > 0
    assert report.prefill_chunks > 0 and report.retracted_requests > 0
    # One transfer per finished prefill (the retracted attempt sent nothing; its retry did).
    assert pd.transferred_requests == report.requests > 0
    assert report.pd_transferred_tokens == pd.transferred_tokens > 0
    assert report.pd_kv_mismatches == 0 and pd.aux_mismatches == 0 and pd.failed_transfers == 0
    assert pd.off_grant_pages_changed == 0 and pd.decode_leaked_tokens == 0
    # Each rank sends its own pages only: every logical page once over the ranks.
    sent = report.pd_sent_bytes_per_rank
    assert len(sent) == 2 and sum(sent) == pd.logical_bytes
    assert all(0 < b < pd.logical_bytes for b in sent)
    assert 1.0 <= pd.sent_bytes_vs_logical <= 1.25
    assert pd.transfer_ms["p50"] > 0


def test_planted_wrong_owner_fails_on_the_decode_side_only() -> None:
    """Upstream's owner filter picks the next rank's lane from each rank's own rows: both
    sides report Success, the prefill side's own checks pass, only decode's bytes fail."""
    report = run_simulation(SimConfig(**{**SMALL, "num_requests": 4}, fault="pd_wrong_owner"))
    pd = report.pd_summary
    assert not report.passed
    assert report.kv_mismatches == 0 and pd.failed_transfers == 0
    assert report.pd_kv_mismatches > 0
    assert [v for v in report.invariant_violations if v.startswith("PD: decode holds wrong bytes")]


def test_the_mtp_draft_is_sent_and_checked_on_decode_and_a_dropped_draft_send_fails() -> None:
    """With ``draft`` each rank also sends its own draft pool's pages (KV and indexer),
    checked on decode against the simulator's draft pattern; dropping the draft's blocks
    before the engine still reports Success and fails on decode's draft check only."""
    report = run_simulation(SimConfig(**{**SMALL, "num_requests": 6}, draft=True))
    pd = report.pd_summary
    assert report.passed and report.draft and report.draft_kv_checked_tokens > 0
    assert pd.transferred_requests == report.requests and pd.kv_mismatches == pd.draft_kv_mismatches == 0
    assert sum(report.pd_sent_bytes_per_rank) == pd.logical_bytes
    dropped = run_simulation(SimConfig(**{**SMALL, "num_requests": 2}, draft=True, fault="pd_drop_draft"))
    pd_dropped = dropped.pd_summary
    assert not dropped.passed and pd_dropped.failed_transfers == 0 and dropped.draft_kv_mismatches == 0
    assert pd_dropped.draft_kv_mismatches == pd_dropped.kv_mismatches == pd_dropped.transferred_tokens > 0
    # One draft layer of three (layer_num 2): a third of every page's bytes never left.
    assert sum(dropped.pd_sent_bytes_per_rank) * 3 == pd_dropped.logical_bytes * 2
