"""The L3 waits of ``testing/v0_5_23/storage.py`` (cp 2, two gloo ranks, file backend).

A prefetch waits as long as upstream's own budget for its pages
(``prefetch_timeout_base + pages * prefetch_timeout_per_page``, the storage's runtime config),
not a fixed step count: under load a 4 s poll gave up on prefetches that were still
running (planted here: a page transfer slower than that poll still lands every page). What
never comes still ends the wait on every rank alike: a transfer that never finishes at the
budget (``TimeoutError``), a storage thread that exited at once (``RuntimeError`` naming
it), both planted in the controller's page transfer.
"""

from __future__ import annotations

import threading
import time
from typing import Dict

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
TOKENS = list(range(1, 4 * PAGE + 1))
SEED = 20261208
BUDGET_BASE_S = 1.5  # the planted hang's budget: short, so the test is
EXITED_BUDGET_S = 120.0  # far longer than the exited thread may take to end the wait
SLOW_S = 10.0  # a slow page transfer: past the old fixed poll (400 x 10 ms), well inside the budget


def _stored(stack, storage, folder: str) -> None:
    storage.attach_storage(stack, "file", extra={"file_storage_path": folder})
    storage.store_request(stack, TOKENS, storage.request_kv(stack, TOKENS, SEED))
    storage.evict_everything(stack)  # only L3 holds TOKENS


def planted(ctx: RankContext, folder: str, plant: str) -> Dict[str, object]:
    """Store TOKENS, then prefetch them with ``plant`` in the page transfer: ``slow``
    (returns after ``SLOW_S``), ``hang`` (never returns until the test ends) or ``raise``
    (its thread exits)."""
    from sglang_cp_hicache.testing.v0_5_23 import storage
    from sglang_cp_hicache.testing.v0_5_23.rank_stack import StackConfig
    from sglang_cp_hicache.testing.v0_5_23.stack import sharded_stack

    report: Dict[str, object] = {}
    release = threading.Event()
    with sharded_stack(ctx, StackConfig(cp_shared_kv=True)) as stack:
        _stored(stack, storage, folder)
        cache, controller = stack.cache, stack.controller
        report["budget"] = storage.l3_budget_s(stack, len(TOKENS) // PAGE)
        report["upstream_budget"] = (cache.prefetch_timeout_base, cache.prefetch_timeout_per_page)
        transfer = controller._page_transfer

        def hang(operation):
            release.wait(EXITED_BUDGET_S)
            return transfer(operation)

        def slow(operation):
            time.sleep(SLOW_S)
            return transfer(operation)

        def fail(operation):
            raise RuntimeError("planted: the page transfer raised")

        controller._page_transfer = {"slow": slow, "hang": hang, "raise": fail}[plant]
        if plant == "hang":
            cache.prefetch_timeout_base = BUDGET_BASE_S  # a runtime config's budget
        started = time.monotonic()
        try:
            # slow: one prefetch that lands late; raise: r1 may still end (the exiting thread acks it)
            for rid in ("r1",) if plant == "slow" else ("r1", "r2"):
                if plant == "raise":
                    storage.prefetch_within(stack, rid, TOKENS, EXITED_BUDGET_S)
                else:
                    report["hit"] = storage.prefetch(stack, rid, TOKENS)  # within l3_budget_s
            report["raised"] = None
        except (TimeoutError, RuntimeError) as error:
            report["raised"] = (type(error).__name__, str(error))
        report["waited_s"] = time.monotonic() - started
        report["hang_budget"] = storage.l3_budget_s(stack, len(TOKENS) // PAGE)
        release.set()  # the hung transfer returns; nothing else waits on it
        controller._page_transfer = transfer
        storage.detach_storage(stack)
    return report


@pytest.fixture(scope="module")
def hang(tmp_path_factory) -> list:
    return run_ranks(2, planted, str(tmp_path_factory.mktemp("l3-hang")), "hang")


def test_a_page_transfer_slower_than_a_fixed_short_poll_still_lands_every_page(tmp_path):
    reports = run_ranks(2, planted, str(tmp_path), "slow")
    for rank, report in enumerate(reports):
        assert report["raised"] is None, f"rank {rank}: {report['raised']}"
        assert report["hit"] == len(TOKENS), f"rank {rank}"
        assert SLOW_S <= report["waited_s"] < report["budget"], f"rank {rank}: {report['waited_s']:.1f} s"


def test_the_budget_is_upstreams_prefetch_budget_for_the_pages(hang):
    for rank, report in enumerate(hang):
        base, per_page = report["upstream_budget"]
        assert (base, per_page) == (30.0, PAGE / 1024), f"rank {rank}: attach_storage's config"
        assert report["budget"] == pytest.approx(30.0 + 4 * PAGE / 1024), f"rank {rank}"


def test_a_transfer_that_never_finishes_times_out_at_the_budget_on_every_rank(hang):
    for rank, report in enumerate(hang):
        budget = report["hang_budget"]
        assert budget == pytest.approx(BUDGET_BASE_S + 4 * PAGE / 1024)
        assert report["raised"] == ("TimeoutError", f"rank {rank}: prefetch r1 not done in {budget:.1f} s")
        assert budget <= report["waited_s"] < budget + 10, f"rank {rank}: {report['waited_s']:.1f} s"


def test_an_exited_storage_thread_ends_the_wait_at_once_on_every_rank(tmp_path):
    reports = run_ranks(2, planted, str(tmp_path), "raise")
    for rank, report in enumerate(reports):
        kind, message = report["raised"]
        assert kind == "RuntimeError", f"rank {rank}: {message}"
        assert "storage thread exited" in message and message.startswith(f"rank {rank}: prefetch r")
        assert report["waited_s"] < EXITED_BUDGET_S / 4, f"rank {rank}: {report['waited_s']:.1f} s"
    assert any("prefetch_io_aux_thread" in report["raised"][1] for report in reports)
