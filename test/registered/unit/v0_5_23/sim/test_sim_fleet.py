"""The fleet replay (``--instances``, ``--router``; sim/fleet), without ranks: one instance
is today's run, a prefix one instance wrote is a storage hit on another over the shared
store (every full page) and a miss over local stores, a page already stored is not written
again, sharing never lowers the fleet's hit rate, and cache_aware follows the match."""

import json
from typing import List, Sequence

import pytest

from sglang_cp_hicache.sim.cli import config_from_args, main, parse_args
from sglang_cp_hicache.sim.config import SimConfig
from sglang_cp_hicache.sim.fleet.report import compare_fleet, format_fleet
from sglang_cp_hicache.sim.fleet.router import Router
from sglang_cp_hicache.sim.fleet.run import run_fleet
from sglang_cp_hicache.sim.workload import Request, load_workload

PAGE = 64
PREFIX = list(range(1000, 1000 + 5 * PAGE + 20))  # 5 full pages and a part


def _trace(*prompts: Sequence[int]) -> List[Request]:
    return [Request(i, f"s{i}", tuple(p)) for i, p in enumerate(prompts)]


def _other(tag: int) -> List[int]:
    return [tag * 10_000 + t for t in range(3 * PAGE)]


def _cfg(**kw) -> SimConfig:
    return SimConfig(cp_size=2, page_size=PAGE, physical_tokens=1024, **kw)


def test_one_instance_is_todays_run() -> None:
    _, plain = parse_args(["--workload", "l3"])
    _, one = parse_args(["--workload", "l3", "--instances", "1"])
    assert plain.instances == one.instances == 1 and plain.router == "round_robin"
    assert config_from_args(plain) == config_from_args(one)  # the same SimConfig: the same run
    cfg = config_from_args(one)
    requests = load_workload(cfg)
    runs = [run_fleet(requests, cfg, 1, router, shared) for router in ("round_robin", "cache_aware") for shared in (True, False)]
    assert len({(tuple(r.hit_rates().items()), tuple(r.written_bytes()), tuple(r.read_bytes())) for r in runs}) == 1


def test_the_second_instance_hits_every_full_page_the_first_wrote() -> None:
    # round robin, one request per instance per round: r0 -> 0, r1 -> 1, r2 -> 0, r3 -> 1
    trace = _trace(PREFIX + _other(1), _other(2), _other(3), PREFIX + _other(4))
    shared = run_fleet(trace, _cfg(), 2, "round_robin", shared=True)
    first, second = shared.meters
    prefix_pages = len(PREFIX) // PAGE
    assert first.storage_hit_tokens == 0
    assert second.storage_hit_tokens == prefix_pages * PAGE  # every full page, not the part
    assert sum(second.read_pages) == prefix_pages
    assert second.dedup_pages == 0  # it read them: nothing to write again
    first_pages = (len(PREFIX) + 3 * PAGE) // PAGE + 3 * PAGE // PAGE
    assert sum(first.written_pages) == first_pages  # its two prompts' full pages
    local = run_fleet(trace, _cfg(), 2, "round_robin", shared=False)
    assert local.meters[1].storage_hit_tokens == 0
    assert sum(local.meters[1].written_pages) == sum(second.written_pages) + prefix_pages


def test_a_page_already_stored_is_not_written_again() -> None:
    # r0 and r1 in one round on two instances: both compute the prefix, one write each page
    trace = _trace(PREFIX + _other(1), PREFIX + _other(2))
    run = run_fleet(trace, _cfg(), 2, "round_robin", shared=True)
    prefix_pages = len(PREFIX) // PAGE
    assert [m.dedup_pages for m in run.meters] == [0, prefix_pages]
    assert sum(sum(m.written_pages) for m in run.meters) == run.stored_pages
    distinct = {tuple(p.token_ids[: (k + 1) * PAGE]) for p in trace for k in range(len(p.token_ids) // PAGE)}
    assert run.stored_pages == len(distinct)


@pytest.mark.parametrize("router", ["round_robin", "cache_aware"])
@pytest.mark.parametrize("instances", [2, 4])
def test_sharing_the_store_never_lowers_the_fleet_hit_rate(instances: int, router: str) -> None:
    cfg = SimConfig.preset("l3", cp_size=2)
    comparison = compare_fleet(load_workload(cfg), cfg, instances, router)
    shared, local = comparison.shared.hit_rates(), comparison.local.hit_rates()
    assert shared["all"] > local["all"] and shared["storage"] > local["storage"]
    assert (shared["device"], shared["host"]) == (local["device"], local["host"])  # same routing, same tiers
    assert sum(comparison.shared.written_bytes()) < sum(comparison.local.written_bytes())
    assert "| shared / local |" in format_fleet(comparison)


def test_cache_aware_takes_the_longest_match_ties_in_turn() -> None:
    router = Router("cache_aware", 3)
    matches = {0: 1, 1: 5, 2: 5}.get
    assert [router.pick([0, 1, 2], matches) for _ in range(3)] == [1, 2, 1]
    rr = Router("round_robin", 3)
    assert [rr.pick([0, 1, 2], matches) for _ in range(4)] == [0, 1, 2, 0]
    assert rr.pick([1, 2], matches) == 1  # a full instance is skipped
    # r1 leaves the prefix on instance 1; r2 continues it: cache_aware sends it there
    trace = _trace(_other(1), PREFIX + _other(2), PREFIX + _other(3), _other(4))
    aware = run_fleet(trace, _cfg(), 2, "cache_aware", shared=True)
    turn = run_fleet(trace, _cfg(), 2, "round_robin", shared=True)
    assert aware.meters[1].device_hit_tokens == len(PREFIX) // PAGE * PAGE
    assert turn.meters[0].storage_hit_tokens == len(PREFIX) // PAGE * PAGE  # read from L3 instead


def test_the_cli_prints_the_fleet_and_refuses_what_it_does_not_model(capsys, tmp_path) -> None:
    out_json = tmp_path / "fleet.json"
    argv = ["--workload", "l3", "--num-requests", "40", "--instances", "2", "--router", "cache_aware"]
    assert main([*argv, "--json", str(out_json)]) == 0
    out = capsys.readouterr().out
    assert "fleet: 2 prefill instances x cp 2, router cache_aware" in out and "| one shared store |" in out
    assert "shared, instance 1: written [" in out  # pages per owner rank
    saved = json.loads(out_json.read_text())
    assert [len(saved[k]["meters"]) for k in ("shared", "local", "single")] == [2, 2, 1]
    assert sum(m["requests"] for m in saved["shared"]["meters"]) == saved["requests"] == 40
    for bad in (["--pd"], ["--storage-backend", "file"], ["--retract-prob", "0.1"], ["--instances", "0"], ["--plot", "x.png"]):
        with pytest.raises(SystemExit) as stop:
            main(["--instances", "2", *bad] if bad[0] != "--instances" else bad)
        assert stop.value.code == 2


def test_the_match_is_on_the_prompt_less_its_last_token() -> None:
    # match_prefix(input[:-1]): a repeated 2-page prompt hits 1 page, as the scheduler's does
    two_pages = list(range(2 * PAGE))
    run = run_fleet(_trace(two_pages, _other(1), two_pages), _cfg(), 1, "round_robin", shared=True)
    assert run.meters[0].device_hit_tokens == PAGE
