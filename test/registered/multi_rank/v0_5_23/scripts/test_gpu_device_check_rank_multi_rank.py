"""The rank side of ``scripts/gpu/device_check.py --sglang 0.5.23`` on two real CPU gloo ranks:
the self-test, the twins (target and MTP draft), the per-layer round trip on the real sharded
stack, and the planted fault of each, judged as the check judges them; then the main
process's kvcacheio and bandwidth with theirs. Every planted fault must be caught here by
the check's own verdict (stale bytes, a failing stage, a differing twin), so a plant that
stopped biting, or a verdict that stopped looking, fails this test."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from sglang_cp_hicache.testing.dist import run_ranks

ROOT = Path(__file__).resolve().parents[5]


@pytest.fixture(scope="module")
def driver():
    spec = importlib.util.spec_from_file_location("gpu_device_check", ROOT / "scripts" / "gpu" / "device_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def checked(driver):
    options = driver.CheckOptions("cpu", 2, 300.0)
    per_rank = run_ranks(2, driver.check_rank_0_5_23, {"device": "cpu", "cp_size": 2, "timeout_s": 300.0}, timeout_s=300)
    main = driver.main_process_0_5_23(torch.device("cpu"))
    return per_rank, main, driver.summarize_0_5_23(per_rank, None, main, options, 1.0)


def test_the_cpu_check_passes_with_every_planted_fault_caught(driver, checked):
    per_rank, main, (ok, lines) = checked
    assert ok, lines
    caught = driver.planted_verdicts(per_rank, main, "cpu")
    assert caught == {name: True for name in driver.PLANTED_0_5_23["cpu"]}


def test_the_twins_ran_target_and_mtp_draft_for_both_formats(driver, checked):
    per_rank, _, _ = checked
    for report in per_rank:
        assert [t["format"] for t in report["twins"]] == list(driver.FORMATS_0_5_23)
        for twin in report["twins"]:
            assert twin["target"]["identical"] and twin["draft"]["identical"]
            assert twin["target"]["table_translated"] and twin["draft"]["table_translated"]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_the_round_trip_acks_on_the_zero_owned_rank_on_each_layout(checked, layout):
    per_rank, _, _ = checked
    first, last = per_rank[0]["round_trip"][layout], per_rank[1]["round_trip"][layout]
    assert first["owned_pages"]["C"] == 0 and last["owned_pages"]["C"] == 1
    assert [r["round_trip"][layout]["acks_after_forward"] for r in per_rank] == [1, 1]
    assert all(r["round_trip"][layout]["acks_before_last_layer"] == 0 for r in per_rank)
    assert all(not any(r["round_trip"][layout]["loaded"].values()) for r in per_rank)


def test_each_planted_fault_was_caught_by_the_checks_own_verdict(checked):
    per_rank, main, _ = checked
    for report in per_rank:
        assert all(e["selftest"]["stage"] in ("gather", "indexer", "translation", "attention")
                   for e in report["planted"]["self-test"]["entries"])  # fmt: skip
        assert not report["planted"]["twin"]["identical"] and not report["planted"]["twin-mtp"]["identical"]
        for layout in ("layer_first", "page_first"):
            assert any(report["planted"][f"round-trip/{layout}/layer_copy_dropped"]["loaded"]["A"])
    assert any("per-layer load" in p for p in main["planted"]["kvcacheio"]["problems"])
    assert not (main["planted"]["bandwidth-sanity"]["d2h_exact"] or main["planted"]["bandwidth-sanity"]["h2d_exact"])
