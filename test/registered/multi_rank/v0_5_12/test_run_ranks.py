"""run_ranks: results in rank order, and a rank that dies without reporting fails the run
at once instead of after the whole timeout."""

from __future__ import annotations

import os
import time

import pytest

from sglang_cp_hicache.testing.dist import RankFailed, run_ranks

TIMEOUT_S = 120.0


def _rank_and_world(ctx):
    return ctx.rank, ctx.world_size


def _exit_without_reporting_on_rank_1(ctx):
    if ctx.rank == 1:
        os._exit(3)  # no Python exception, no report: what a killed or crashed rank does
    return ctx.rank


def _raise_on_rank_0(ctx):
    if ctx.rank == 0:
        raise ValueError("planted failure")
    return ctx.rank


def test_results_come_back_in_rank_order():
    assert run_ranks(3, _rank_and_world) == [(0, 3), (1, 3), (2, 3)]


def test_rank_exiting_without_report_fails_fast():
    start = time.monotonic()
    with pytest.raises(RankFailed, match="rank 1: exited with code 3 without reporting"):
        run_ranks(2, _exit_without_reporting_on_rank_1, timeout_s=TIMEOUT_S)
    assert time.monotonic() - start < TIMEOUT_S / 2


def test_rank_exception_carries_its_traceback():
    with pytest.raises(RankFailed, match="(?s)rank 0:.*ValueError: planted failure"):
        run_ranks(2, _raise_on_rank_0)
