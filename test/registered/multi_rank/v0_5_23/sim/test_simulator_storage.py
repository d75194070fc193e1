"""The simulator's HiCache L3 tier on the 0.5.23 line (``SimConfig.storage_backend``).

A cp 2 run on the file backend (small pools, a tight host tier): the plugin column's owners write
and read their pages under owner-free keys, the cp-1 upstream column runs upstream's own file
backend; every storage hit loads back like a host hit and is byte-checked on its owner. A
second run at cp 3 on the same folder (a restart) reads the first run's pages. A planted
fault (the last rank's storage reads land wrong bytes in host memory) is caught by the hit
check as mismatches. The first run also replays upstream cp 1 with cp x the per-rank pools
(``storage_logical_baseline``: the same logical L1 + L2 as the cp ranks), the column the
storage-hit target is judged against. The line refuses what it cannot run before any rank
starts.
"""

from __future__ import annotations

import os
import shutil

import pytest

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.lines import LineSim
from sglang_cp_hicache.sim.report.table import format_table
from sglang_cp_hicache.sim.simulation import run_simulation

#: Small pools and a 1.25x host tier: pages of sessions that return are evicted from the
#: cp-2 host tier within 30 requests, so both columns hit storage. Later runs replay the
#: trace's first requests only: their prefixes are in the first run's folder.
SMALL = dict(
    num_requests=30, physical_tokens=768, hicache_ratio=1.25, max_active_sessions=6,
    max_prompt_len=640, native_column=False, tree_digest_every=4,
)  # fmt: skip


def _config(cp_size: int, folder: str, **overrides) -> SimConfig:
    return SimConfig(cp_size=cp_size, storage_backend="file", storage_dir=folder,
                     **{**SMALL, **overrides})  # fmt: skip


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("l3"))


@pytest.fixture(scope="module")
def first(folder):
    return run_simulation(_config(2, folder, storage_logical_baseline=True))


@pytest.fixture(scope="module")
def restart(first, folder, tmp_path_factory):
    # A copy: the fault test below reads the first run's folder as it was left.
    copy = str(tmp_path_factory.mktemp("restart") / "l3")
    shutil.copytree(folder, copy)
    return run_simulation(_config(3, copy, baseline=False, num_requests=12))


def test_cp2_file_run_passes_with_byte_checked_storage_hits(first):
    assert first.passed, first.invariant_violations[:5]
    assert first.kv_mismatches == 0
    assert first.storage_hit_tokens > 0
    storage = first.storage_summary
    assert storage.backend_class == "OwnerFreeHiCacheFile"
    assert all(written > 0 for written in storage.written_bytes_per_rank), "every rank owns pages"
    assert sum(storage.read_bytes_per_rank) >= first.storage_hit_tokens * first.bytes_per_token
    assert storage.prior_run_read_pages == 0  # a fresh folder
    upstream = first.columns["upstream"]
    assert upstream.passed
    assert upstream.storage_backend_class == "HiCacheFile"  # upstream's own keys at cp 1
    assert storage.upstream_hit_tokens == upstream.storage_hit_tokens > 0
    assert first.hot_path_collectives == 0


def test_the_logical_baseline_runs_upstream_with_cp_times_the_pools_and_its_own_store(first, folder):
    logical, upstream = first.columns["upstream_logical"], first.columns["upstream"]
    assert list(first.columns) == ["plugin", "upstream", "upstream_logical"]
    assert logical.passed and logical.world_size == 1 and logical.label == "cp=1 upstream x2"
    assert logical.storage_backend_class == "HiCacheFile"
    # Its host held more than the same-memory column's whole host pool can (768 x 1.25).
    assert max(logical.host_bytes_per_rank) > int(768 * 1.25) * first.bytes_per_token
    assert logical.device_evicted_tokens < upstream.device_evicted_tokens
    assert os.listdir(os.path.join(folder, "upstream_logical")), "it writes its own folder"
    storage = first.storage_summary
    assert storage.logical_upstream_hit_tokens == logical.storage_hit_tokens
    assert storage.logical_upstream_hit_tokens_total == logical.device_hit_tokens + logical.host_hit_tokens
    assert storage.logical_upstream_written_bytes == logical.storage_written_bytes_per_rank[0] > 0
    assert {"storage hit tokens >= upstream cp 1", "storage hit tokens >= upstream cp 1, same logical L2",
            "all hit tokens >= upstream cp 1, same logical L2"} <= set(storage.targets)  # fmt: skip
    table = format_table(first)
    assert "cp=1 upstream x2" in table and "same logical L1 + L2" in table


def test_restart_at_another_cp_size_reads_the_first_runs_pages(restart):
    assert restart.passed, restart.invariant_violations[:5]
    assert restart.storage_summary.prior_run_read_pages > 0
    assert restart.storage_hit_tokens > 0
    assert restart.kv_mismatches == 0


def test_a_storage_read_with_wrong_bytes_is_caught_as_a_mismatch(first, folder, tmp_path):
    copy = str(tmp_path / "l3")
    shutil.copytree(folder, copy)  # a restart: the first requests' prefixes come from storage
    report = run_simulation(
        _config(2, copy, baseline=False, num_requests=6, fault="storage_wrong_bytes")
    )
    assert not report.passed
    assert report.kv_mismatches > 0
    assert report.storage_summary.prior_run_read_pages > 0


def test_the_line_refuses_storage_it_cannot_run_before_any_rank_starts():
    from sglang_cp_hicache.sim.v0_5_23.rank import LINE

    without_storage = LineSim("0.5.12.post1", False, True, LINE.sharded_main, LINE.upstream_main, "layer_first")
    with pytest.raises(ValueError, match="runs no HiCache L3 storage"):
        without_storage.check(SimConfig(storage_backend="file"))
    with pytest.raises(ValueError, match="refuses --hicache-storage-backend"):
        LINE.check(SimConfig(storage_backend="file", shard_impl="native"))
    with pytest.raises(ValueError, match="page_first"):
        LINE.check(SimConfig(storage_backend="mooncake", mem_layout="layer_first"))
    LINE.check(SimConfig(storage_backend="mooncake"))  # unset: upstream's page_first
    with pytest.raises(ValueError, match="storage_dir"):
        SimConfig(storage_dir="/tmp/x")
    with pytest.raises(ValueError, match="storage_mooncake_master is a Mooncake store"):
        SimConfig(storage_backend="file", storage_mooncake_master="127.0.0.1:50051")
