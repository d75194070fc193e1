"""The 0.5.23 simulator's plugin column with per-layer D2H backup (the default there, on
either host layout): host slots reserved by ``Scheduler.run_batch``'s hook, each layer stored
through the sharded pool's own door (its store hook backs the layer up), the forward ended
by ``ModelRunner.forward``'s hook, one ack per forward, together with chunked prefill,
aborts, retractions and writes in flight; and a planted fault in the per-layer path fails
the run (so a green run means the checks ran). On page_first (0.5.23's default layout, the
one Mooncake needs) the same, with the Mooncake store attached: no page goes to L3 before
its per-layer backup's ack (a planted early L3 write fails the run)."""

from typing import Iterator

import pytest

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.report.records import SimReport
from sglang_cp_hicache.sim.simulation import run_simulation

LAYERS = 2
# One column, cp 2: chunks, aborts, retractions and acks landing two steps late, with a
# host tier small enough to evict (and so to serve host hits).
WORKLOAD = dict(
    cp_size=2, seed=0, num_requests=24, batch_size=2, chunked_prefill_size=256, abort_prob=0.1,
    retract_prob=0.15, inflight_steps=2, hicache_ratio=1.5, layer_num=LAYERS, native_column=False,
    baseline=False, timeout_s=120,
)  # fmt: skip


@pytest.fixture(scope="module")
def report() -> SimReport:
    return run_simulation(SimConfig(**{**WORKLOAD, "mem_layout": "layer_first"}))


@pytest.fixture(scope="module")
def page_first() -> SimReport:
    """The layout unset: upstream's default, as a launch without --hicache-mem-layout."""
    return run_simulation(SimConfig(**WORKLOAD))


def test_per_layer_backup_with_every_scheduler_feature_passes(report: SimReport) -> None:
    assert report.passed, report.invariant_violations[:5]
    assert report.invariant_violations == [] and report.kv_mismatches == 0
    assert report.kv_checked_tokens == report.device_hit_tokens + report.host_hit_tokens
    assert report.host_hit_tokens > 0  # host copies written layer by layer were read back
    assert report.prefill_chunks > 0 and report.aborted_requests > 0 and report.retracted_requests > 0
    assert report.leaked_device_slots == 0 and report.leaked_host_slots == 0
    # Each logical page moved once, by its owner, per layer or all layers.
    assert sum(report.d2h_bytes_per_rank) == report.replicated_d2h_bytes > 0


def test_the_per_layer_path_ran_one_ack_per_forward_after_every_layer(report: SimReport) -> None:
    assert report.per_layer_forwards > 0
    assert report.per_layer_layers == LAYERS * report.per_layer_forwards
    assert report.per_layer_acks == report.per_layer_forwards
    # Claimed nodes were published at their ack; retracted requests' slots rolled back.
    assert report.pending_committed > 0 and report.pending_rolled_back > 0


def test_per_layer_backup_on_page_first_passes_with_byte_checked_host_hits(page_first: SimReport) -> None:
    assert page_first.config["mem_layout"] == "page_first"  # what ran, though unset
    assert page_first.passed, page_first.invariant_violations[:5]
    assert page_first.kv_mismatches == 0
    assert page_first.kv_checked_tokens == page_first.device_hit_tokens + page_first.host_hit_tokens
    assert page_first.host_hit_tokens > 0  # host copies written layer by layer into page_first, read back
    assert page_first.per_layer_forwards > 0
    assert page_first.per_layer_layers == LAYERS * page_first.per_layer_forwards
    assert page_first.per_layer_acks == page_first.per_layer_forwards
    assert page_first.pending_committed > 0
    assert sum(page_first.d2h_bytes_per_rank) == page_first.replicated_d2h_bytes > 0


# Mooncake on page_first (small pools, a tight host tier: pages of returning sessions are
# evicted from host, so L3 serves hits); one request per batch, acks at once.
MOONCAKE = dict(
    cp_size=2, seed=0, num_requests=30, physical_tokens=768, hicache_ratio=1.25, max_active_sessions=6,
    max_prompt_len=640, layer_num=LAYERS, mem_layout="page_first", storage_backend="mooncake",
    native_column=False, baseline=False, timeout_s=120,
)  # fmt: skip


@pytest.fixture(scope="module")
def held_store() -> Iterator[str]:
    """A Mooncake store that outlives the runs (a master and a held segment)."""
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import held_mooncake_store

    with held_mooncake_store(256 << 20) as master:
        yield master


@pytest.fixture(scope="module")
def mooncake(held_store: str) -> SimReport:
    return run_simulation(SimConfig(**MOONCAKE, storage_mooncake_master=held_store))


def test_per_layer_backup_with_mooncake_writes_l3_only_after_each_ack(mooncake: SimReport) -> None:
    assert mooncake.passed, mooncake.invariant_violations[:5]
    assert mooncake.storage_summary.backend_class == "OwnerFreeMooncakeStore"
    assert mooncake.kv_mismatches == 0 and mooncake.storage_hit_tokens > 0  # L3 hits byte-checked
    assert mooncake.kv_checked_tokens == mooncake.device_hit_tokens + mooncake.host_hit_tokens
    assert mooncake.per_layer_acks == mooncake.per_layer_forwards > 0
    # Per-layer backups reached L3 through upstream's write at their ack (none earlier: checked).
    assert mooncake.per_layer_l3_writes > 0


def test_a_cp4_restart_reads_the_cp2_runs_pages_through_the_store(mooncake: SimReport, held_store: str) -> None:
    """The trace's first requests at cp 4 on the store the cp-2 run filled, against the
    same run on a fresh store: fresh L1 and L2 both times, so the extra L3 hits are the
    cp-2 run's pages, read by other owners and byte-checked on them. (The replayed prompts'
    whole pages all come from L3 there, so the restart may have no new page to back up.)"""
    short = {**MOONCAKE, "cp_size": 4, "num_requests": 8}
    restart = run_simulation(SimConfig(**short, storage_mooncake_master=held_store))
    fresh = run_simulation(SimConfig(**short))
    for report in (restart, fresh):
        assert report.passed, report.invariant_violations[:5]
        assert report.kv_mismatches == 0
        assert report.kv_checked_tokens == report.device_hit_tokens + report.host_hit_tokens
        assert report.per_layer_acks == report.per_layer_forwards
    assert fresh.per_layer_forwards > 0
    assert restart.storage_hit_tokens > fresh.storage_hit_tokens
    assert restart.host_hit_tokens > fresh.host_hit_tokens  # L3 hits load back as host hits


def test_an_l3_write_before_the_per_layer_ack_fails_the_run() -> None:
    report = run_simulation(SimConfig(**{**MOONCAKE, "num_requests": 6, "fault": "early_l3_write"}))
    assert not report.passed
    assert any("before the ack of their per-layer backup" in v for v in report.invariant_violations), (
        report.invariant_violations[:5]
    )


def test_all_layer_backup_on_the_plugin_column_reserves_nothing() -> None:
    report = run_simulation(SimConfig(**{**WORKLOAD, "num_requests": 6, "per_layer_backup": False}))
    assert report.passed, report.invariant_violations[:5]
    assert report.per_layer_forwards == report.per_layer_layers == report.pending_committed == 0
    assert sum(report.d2h_bytes_per_rank) == report.replicated_d2h_bytes > 0


@pytest.mark.parametrize(
    "fault, caught",
    [
        # The last rank acks after layer 0: its ack-order check fires and its last layer
        # never reaches host (the host hits' byte check too, once one is read back).
        ("early_layer_ack", lambda r: any(v.startswith("rank 1 ") and "before the last layer" in v
                                          for v in r.invariant_violations)),
        # Layer 0's report is lost on every rank: the backup refuses the forward, every rank stops.
        ("skip_backup_layer", lambda r: any("per-layer backup refused the forward" in v and "before layer 0" in v
                                            for v in r.invariant_violations)),
    ],
)  # fmt: skip
def test_a_fault_in_the_per_layer_path_fails_the_run(fault, caught) -> None:
    report = run_simulation(SimConfig(**{**WORKLOAD, "num_requests": 8, "fault": fault}))
    assert not report.passed
    assert caught(report), report.invariant_violations[:5]


@pytest.mark.parametrize(
    "overrides, message",
    [
        # Upstream's sharded DSA HiCache refuses it before per-layer backup matters.
        (dict(mem_layout="page_first_direct"), "mem_layout must be one of"),
        (dict(per_layer_backup=True, shard_impl="native"), "native sharding backs up all layers"),
        (dict(fault="early_layer_ack", per_layer_backup=False), "needs the plugin column's per-layer"),
    ],
)
def test_the_line_refuses_per_layer_where_it_cannot_run(overrides, message) -> None:
    with pytest.raises(ValueError, match=message):
        run_simulation(SimConfig(**overrides))


def test_unset_means_per_layer_on_either_layout() -> None:
    from sglang_cp_hicache.sim.v0_5_23.rank import LINE

    assert LINE.resolved_per_layer_backup(SimConfig()) is True  # page_first
    assert LINE.resolved_per_layer_backup(SimConfig(mem_layout="layer_first")) is True
    assert LINE.resolved_per_layer_backup(SimConfig(per_layer_backup=False)) is False
