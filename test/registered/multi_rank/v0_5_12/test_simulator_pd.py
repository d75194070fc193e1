"""The simulator with PD (``SimConfig.pd``): every finished prefill of the plugin's column goes
from its CP ranks over a real Mooncake engine (loopback TCP) to one decode process with a full
pool, and is checked there byte for byte (``sim/pd.py``, ``sim/v0_5_12/pd.py``).

Both sides of a transfer report Success even when the bytes are wrong, so the planted wrong
owner filter below must fail the run on the decode side's check alone.
"""

from __future__ import annotations

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, parse_args
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.simulation import run_simulation
from sglang_cp_hicache.testing.pd.scenario import SIM_PD_SMALL_TRACE

SMALL = SIM_PD_SMALL_TRACE


def test_every_finished_prefill_is_transferred_and_checked_on_decode() -> None:
    report = run_simulation(SimConfig(**SMALL, draft=True))
    pd = report.pd_summary
    assert report.invariant_violations == [] and report.passed
    # The trace covered device hits, host load-backs, chunked prefills and a retraction.
    assert report.device_hit_tokens > 0 and report.host_hit_tokens > 0
    assert report.prefill_chunks > 0 and report.retracted_requests > 0
    # One transfer per finished prefill (the retracted attempt sent nothing; its retry
    # did), all checked.
    assert pd.transferred_requests == report.requests
    assert report.pd_transferred_tokens == pd.transferred_tokens > 0
    assert report.pd_kv_mismatches == 0 and pd.aux_mismatches == 0 and pd.failed_transfers == 0
    assert pd.off_grant_pages_changed == 0 and pd.decode_leaked_tokens == 0
    # Each rank sends its own pages only: every logical page once over the ranks (KV,
    # indexer and the draft's), about half each.
    sent = report.pd_sent_bytes_per_rank
    assert len(sent) == 2 and sum(sent) == pd.logical_bytes
    assert all(0 < b < pd.logical_bytes for b in sent)
    assert 1.0 <= pd.sent_bytes_vs_logical <= 1.25
    assert pd.transfer_ms["p50"] > 0
    data = report.to_dict()
    for key in ("pd_transferred_tokens", "pd_kv_mismatches", "pd_sent_bytes_per_rank", "pd_summary"):
        assert key in data, key


def test_planted_wrong_owner_filter_fails_on_the_decode_side_only() -> None:
    """Each rank sends the next rank's lane from its own slots: both sides report Success,
    the prefill side's own checks pass, and only decode's byte check fails the run."""
    report = run_simulation(SimConfig(**{**SMALL, "num_requests": 4}, fault="pd_wrong_owner"))
    pd = report.pd_summary
    assert not report.passed
    assert report.kv_mismatches == 0 and pd.failed_transfers == 0
    assert report.pd_kv_mismatches > 0
    assert [v for v in report.invariant_violations if v.startswith("PD: decode holds wrong bytes")]


def test_pd_options_and_refusals() -> None:
    assert config_from_args(parse_args(["--pd", "--no-progress"])[1]) == SimConfig(pd=True)
    assert config_from_args(parse_args(["--no-progress"])[1]).pd is False  # opt-in
    assert "--pd" in parse_args([])[0].format_help()
    with pytest.raises(ValueError, match="needs pd=True"):
        SimConfig(fault="pd_wrong_owner")
    with pytest.raises(ValueError, match="cp_size >= 2"):
        SimConfig(cp_size=1, pd=True)


def test_the_pd_summary_fails_on_each_decode_side_problem() -> None:
    """The report's PD checks, in one process: a clean pair of ranks and decode passes;
    each decode-side problem, a lost transfer and a page sent twice are violations."""
    from types import SimpleNamespace

    from sglang_cp_hicache.sim.report.pd import pd_summary
    from sglang_cp_hicache.sim.results import PDDecodeStats, PDRankStats, RankCounters

    def ranks(sent=(300, 100), requests=2):
        stats = [PDRankStats(requests=requests, tokens=200, pages=4, page_bytes=100, sent_bytes=b) for b in sent]
        return [SimpleNamespace(rank=r, pd=s, counters=RankCounters(requests=2)) for r, s in enumerate(stats)]

    def decode(**changes):
        return PDDecodeStats(**{**dict(requests=2, tokens=200, transfer_s=[0.01, 0.02]), **changes})

    clean = pd_summary(ranks(), decode())
    assert clean.problems == [] and clean.logical_bytes == 400 and clean.sent_bytes_vs_logical == 1.5
    for changes, message in (
        (dict(kv_mismatches=3), "decode holds wrong bytes"),
        (dict(draft_kv_mismatches=1), "decode holds wrong bytes"),
        (dict(aux_mismatches=1), "first token"),
        (dict(off_grant_pages_changed=1), "never granted"),
        (dict(leaked_tokens=64), "not back"),
        (dict(requests=1), "do not match the finished prefills"),
        (dict(failures=["r: Failed"]), "PD transfer failed"),
    ):
        problems = pd_summary(ranks(), decode(**changes)).problems
        assert any(message in p for p in problems), (changes, problems)
    assert any("!= logical" in p for p in pd_summary(ranks(sent=(300, 200)), decode()).problems)
