"""The 0.5.23 simulator with the packed MTP draft (``--draft``): upstream packs the draft's
NextN layer as the host pools' tail layer in the target's slots, so every column carries
it; every hit's draft bytes are checked on the owner's device rows like the target's (after
a load-back too), and a draft-only loss is a draft mismatch, never a good hit."""

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, parse_args
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.report.records import SimReport
from sglang_cp_hicache.sim.simulation import run_simulation

PLUGIN_ONLY = dict(native_column=False, baseline=False, timeout_s=120)


@pytest.fixture(scope="module")
def draft_report() -> SimReport:
    """The plugin column with per-layer backup and its features (chunks, aborts,
    retractions, acks in flight) under host pressure."""
    return run_simulation(
        SimConfig(
            cp_size=2, seed=0, num_requests=30, batch_size=2, chunked_prefill_size=256,
            abort_prob=0.1, retract_prob=0.1, inflight_steps=2, draft=True, **PLUGIN_ONLY,
        )  # fmt: skip
    )


def test_every_hit_checks_the_draft_bytes_and_all_pass(draft_report: SimReport) -> None:
    report = draft_report
    assert report.invariant_violations == [] and report.passed
    assert report.draft and report.draft_kv_mismatches == 0 and report.kv_mismatches == 0
    hits = report.device_hit_tokens + report.host_hit_tokens
    assert report.draft_kv_checked_tokens == report.kv_checked_tokens == hits
    assert report.host_hit_tokens > 0 and report.host_evictions > 0 and report.pending_committed > 0
    assert report.per_layer_acks == report.per_layer_forwards > 0  # one ack, after the draft's layer
    assert report.leaked_host_slots == 0 and report.hot_path_collectives == 0


def test_the_draft_moves_in_the_target_slots_on_its_owner_only(draft_report: SimReport) -> None:
    report = draft_report
    layers = report.config["layer_num"]
    # One tail layer of (latent + indexer) per token, packed in the target's host slots.
    assert report.draft_bytes_per_token * layers == report.bytes_per_token
    for draft, target in (
        (report.draft_d2h_bytes_per_rank, report.d2h_bytes_per_rank),
        (report.draft_h2d_bytes_per_rank, report.h2d_bytes_per_rank),
        (report.draft_host_bytes_per_rank, report.host_bytes_per_rank),
    ):
        assert [d * layers for d in draft] == target
    assert sum(report.draft_d2h_bytes_per_rank) * layers == report.replicated_d2h_bytes > 0


def test_draft_only_loss_is_a_draft_mismatch_not_a_hit() -> None:
    """The last rank's load-backs restore the target's layers but not the draft's tail
    layer: every target byte checks out, the hits still fail as draft mismatches."""
    report = run_simulation(
        SimConfig(cp_size=2, seed=0, num_requests=20, draft=True, fault="drop_last_rank_draft_loads", **PLUGIN_ONLY)
    )
    assert report.draft and report.kv_mismatches == 0 and report.host_hit_tokens > 0
    assert report.draft_kv_mismatches > 0 and not report.passed
    assert report.invariant_violations
    assert all(v.startswith("rank 1 ") and "wrong MTP draft KV/indexer bytes" in v for v in report.invariant_violations)


def test_every_column_carries_the_draft_and_the_cli_takes_it() -> None:
    assert config_from_args(parse_args(["--draft", "--no-progress"])[1]) == SimConfig(draft=True)
    report = run_simulation(SimConfig(cp_size=2, seed=0, num_requests=8, draft=True, timeout_s=120))
    assert report.passed, report.invariant_violations
    for name, summary in report.columns.items():
        assert summary.passed, name
