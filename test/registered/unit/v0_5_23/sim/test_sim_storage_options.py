"""The simulator's L3 options, without ranks: the same-logical-L2 upstream column
(``storage_logical_baseline``) is asked for, refused, parsed and given its own store as
documented, and the large L3 workload is what its figures say."""

import os

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, parse_args
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.lines import LineSim
from sglang_cp_hicache.sim.v0_5_23.storage import open_storage


def _line() -> LineSim:
    return LineSim("x.y", True, None, sharded_main=print, upstream_main=print, mem_layout="page_first")


def test_the_logical_baseline_is_a_fourth_column_on_one_rank_with_the_runs_storage() -> None:
    cfg = SimConfig(cp_size=4, storage_backend="file", storage_logical_baseline=True)
    columns = _line().columns(cfg, "storage")
    assert [(c.name, c.world_size) for c in columns] == [
        ("plugin", 4), ("native", 4), ("upstream", 1), ("upstream_logical", 1),
    ]  # fmt: skip
    logical = columns[-1]
    assert logical.label == "cp=1 upstream x4"
    assert logical.args == ("storage", "upstream_logical")  # upstream_main(..., storage_run, column)
    assert columns[2].args == ("storage",)  # the same-memory column is unchanged
    off = SimConfig(cp_size=4, storage_backend="file")
    assert "upstream_logical" not in [c.name for c in _line().columns(off, "storage")]


def test_the_logical_baseline_needs_storage() -> None:
    with pytest.raises(ValueError, match="storage_logical_baseline compares L3 hits"):
        SimConfig(storage_logical_baseline=True)


def test_the_cli_flag_sets_it() -> None:
    _, args = parse_args(["--workload", "l3", "--storage-backend", "file", "--storage-logical-baseline"])
    assert config_from_args(args).storage_logical_baseline is True
    _, args = parse_args(["--storage-backend", "file"])
    assert config_from_args(args).storage_logical_baseline is False


def test_the_file_backend_gives_the_logical_baseline_its_own_folder(tmp_path) -> None:
    with open_storage(SimConfig(storage_backend="file", storage_dir=str(tmp_path / "a"))) as run:
        assert sorted(run.folders) == ["plugin", "upstream"]
    cfg = SimConfig(storage_backend="file", storage_dir=str(tmp_path / "b"), storage_logical_baseline=True)
    with open_storage(cfg) as run:
        assert run.extra_config("upstream_logical") == {
            "file_storage_path": str(tmp_path / "b" / "upstream_logical")
        }
        assert os.path.isdir(run.folders["upstream_logical"])


def test_the_large_l3_workload_outgrows_cp4s_logical_tiers() -> None:
    cfg = SimConfig.preset("l3_large", cp_size=4)
    assert (cfg.num_requests, cfg.max_active_sessions, cfg.hicache_ratio) == (400, 32, 1.5)
    logical_tokens = cfg.cp_size * cfg.physical_tokens * (1 + cfg.hicache_ratio)
    # 32 open sessions, each growing to max_prompt_len: over twice what cp 4's lanes hold.
    assert cfg.max_active_sessions * cfg.max_prompt_len > 2 * logical_tokens
