"""Materialisation flag, strategy choice by bytes, and the dedicated CP process group."""

import pytest
import torch

from sglang_cp_hicache.v0_5_12.layers.attention import cp_shared_kv_collectives as coll
from sglang_cp_hicache.testing.dist import run_ranks


def test_flag_parses_through_sglang_and_defaults_to_auto(plugins_loaded):
    from sglang.srt.server_args import ServerArgs, prepare_server_args

    base = ["--model-path", "dummy"]
    assert coll.materialize_choice(prepare_server_args(base)) == "auto"
    parsed = prepare_server_args(base + [coll.MATERIALIZE_FLAG, "all_reduce"])
    assert coll.materialize_choice(parsed) == "all_reduce"
    with pytest.raises(SystemExit):
        prepare_server_args(base + [coll.MATERIALIZE_FLAG, "broadcast"])
    kw = ServerArgs(model_path="dummy", **{coll.MATERIALIZE_DEST: "all_gather"})
    assert coll.materialize_choice(kw) == "all_gather"
    assert coll.materialize_choice(object()) == "auto"


def test_auto_picks_all_gather_on_nccl_and_all_reduce_on_gloo(monkeypatch):
    monkeypatch.delenv(coll.STRATEGY_ENV, raising=False)
    assert coll.resolve_strategy("auto", "nccl") == "all_gather"
    assert coll.resolve_strategy("auto", "gloo") == "all_reduce"
    assert coll.resolve_strategy("all_reduce", "nccl") == "all_reduce"
    monkeypatch.setenv(coll.STRATEGY_ENV, "all_reduce")
    assert coll.resolve_strategy("auto", "nccl") == "all_reduce"
    assert coll.resolve_strategy("all_gather", "nccl") == "all_gather"  # the flag wins
    monkeypatch.setenv(coll.STRATEGY_ENV, "bogus")
    with pytest.raises(ValueError, match="bogus"):
        coll.resolve_strategy("auto", "nccl")


@pytest.mark.parametrize("cp", [2, 4, 8])
def test_all_gather_moves_about_half_the_bytes_of_the_ring_all_reduce(cp):
    prefix = 131072 * 788
    gather, reduce = coll.bytes_per_rank("all_gather", prefix, cp), coll.bytes_per_rank("all_reduce", prefix, cp)
    assert reduce == 2 * gather
    assert gather == (cp - 1) * prefix // cp
    assert coll.bytes_per_rank("all_gather", prefix, 1) == 0


def test_missing_group_fails_fast(monkeypatch):
    monkeypatch.setattr(coll, "_materialize_group", None)
    with pytest.raises(RuntimeError, match="not created at init"):
        coll.materialize_group()


def _group_rank(ctx, cp_groups):
    import torch.distributed as dist

    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_materialize import PagedLayerGeometry
    from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_selftest import run_selftest
    from sglang_cp_hicache.core.cp_shared_kv_layout import CpSharedKVLayout

    mine = next(g for g in cp_groups if ctx.rank in g)
    group = coll.create_materialize_group(mine)
    assert coll.materialize_group() is group
    geometry = PagedLayerGeometry(64, torch.bfloat16, (1, 576), 64 * 1152, 64 * 132)
    layout = CpSharedKVLayout(len(mine), mine.index(ctx.rank), 64)
    report = run_selftest(geometry, layout, group, "all_gather", torch.device("cpu"))
    return {
        "size": dist.get_world_size(group),
        "ranks": sorted(dist.get_process_group_ranks(group)),
        "not_world": group is not dist.group.WORLD and group is not ctx.cp_group,
        "round_trip": "round_trip" in report.stages,
    }


def test_every_rank_gets_its_own_group_with_its_cp_ranks():
    cp_groups = [[0, 1], [2, 3]]
    for rank, out in enumerate(run_ranks(4, _group_rank, cp_groups)):
        expected = cp_groups[rank // 2]
        assert out == {"size": 2, "ranks": expected, "not_world": True, "round_trip": True}, (rank, out)
