"""The 0.5.23 simulator's own checkers, in one process: the KV pattern checks bytes on the
real stack's rows and a poisoned row fails it; declined inserts are priced on page-aligned
shared prefixes only; each line runs and refuses exactly what it says."""

import pytest
import torch

from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.lines import LineSim
from sglang_cp_hicache.sim.v0_5_23.observed_cache import DeclinedInsert
from sglang_cp_hicache.testing.server_defaults import upstream_default


@pytest.fixture(scope="module")
def stack(gloo_world1):
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import build_unsharded_stack

    with build_unsharded_stack(gloo_world1, StackConfig(device_pages_per_rank=4, context_len=512)) as built:
        yield built


def test_the_pattern_passes_and_a_poisoned_or_foreign_row_fails(stack) -> None:
    from sglang_cp_hicache.sim.v0_5_23.checks import poison_owned, verify_hit, write_prefill_kv

    locs = torch.arange(64, 64 + 100)
    tokens = torch.arange(1000, 1100)
    write_prefill_kv(stack, locs, tokens, torch.arange(100))
    assert verify_hit(stack, locs, tokens) == (0, 100)
    # Other tokens' bytes (e.g. a load that copied the wrong rows) are a mismatch.
    assert verify_hit(stack, locs, tokens + 1) == (100, 100)
    poison_owned(stack, locs[:30])
    assert verify_hit(stack, locs, tokens) == (30, 100)
    write_prefill_kv(stack, locs[:30], tokens[:30], torch.arange(30))
    assert verify_hit(stack, locs, tokens) == (0, 100)


def test_declined_keys_price_page_aligned_shared_prefixes() -> None:
    from sglang_cp_hicache.sim.v0_5_23.sim_req import RejectedKeys

    keys = RejectedKeys(page_size=4)
    keys.add(DeclinedInsert(tuple(range(10)), matched_len=4))
    keys.add(DeclinedInsert((1, 2, 3), matched_len=0))  # shorter than a page: never matches
    assert keys.potential_match(list(range(12))) == 8  # 10 shared tokens, 8 page-aligned
    assert keys.potential_match([0, 1, 2, 3, 4, 5, 9, 9, 9]) == 4
    assert keys.potential_match([7] + list(range(1, 12))) == 0  # another first page
    assert keys.potential_match(list(range(9))) == 8  # the match stops before the last token
    assert DeclinedInsert(tuple(range(10)), matched_len=4).rejected_tokens == 6


def _line(native_sharding: bool, per_layer_backup) -> LineSim:
    return LineSim(
        "x.y", native_sharding, per_layer_backup, sharded_main=print, upstream_main=print, mem_layout="layer_first"
    )


def test_columns_follow_the_config_and_the_line() -> None:
    with_native = _line(True, None)
    assert [c.name for c in with_native.columns(SimConfig())] == ["plugin", "native", "upstream"]
    assert [c.name for c in with_native.columns(SimConfig(native_column=False, baseline=False))] == ["plugin"]
    native_main = with_native.columns(SimConfig(cp_size=3, shard_impl="native"))
    assert [(c.name, c.world_size, c.args) for c in native_main] == [("native", 3, ("native",)), ("upstream", 1, ())]
    assert [c.name for c in _line(False, True).columns(SimConfig())] == ["plugin", "upstream"]


def test_each_line_refuses_what_it_lacks_and_resolves_its_defaults() -> None:
    without_native = _line(False, True)
    with pytest.raises(ValueError, match="has no native KV sharding"):
        without_native.check(SimConfig(shard_impl="native"))
    assert without_native.resolved_per_layer_backup(SimConfig()) is True
    assert without_native.resolved_per_layer_backup(SimConfig(per_layer_backup=False)) is False
    no_per_layer = _line(True, None)
    with pytest.raises(ValueError, match="no per-layer D2H backup"):
        no_per_layer.check(SimConfig(per_layer_backup=True))
    no_per_layer.check(SimConfig(per_layer_backup=False))
    assert no_per_layer.resolved_per_layer_backup(SimConfig()) is False
    assert no_per_layer.resolved_mem_layout(SimConfig()) == "layer_first"
    assert no_per_layer.resolved_mem_layout(SimConfig(mem_layout="page_first")) == "page_first"
    with pytest.raises(ValueError, match="shard_impl must be one of"):
        SimConfig(shard_impl="both")


def test_the_installed_line_is_0_5_23_and_checks_its_limits() -> None:
    from sglang_cp_hicache.sim.lines import installed_line

    line = installed_line()
    assert line.release == "0.5.23" and line.native_sharding
    line.check(SimConfig())
    assert line.resolved_mem_layout(SimConfig()) == upstream_default("hicache_mem_layout") == "page_first"
    with pytest.raises(ValueError, match="page_size must be 64"):
        line.check(SimConfig(page_size=32, physical_tokens=1024))
