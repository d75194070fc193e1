"""PD disaggregation of CP-sharded KV over a real Mooncake transfer engine (loopback TCP).

cp prefill rank processes (the plugin's real stack under upstream's PD prefill path), one
decode process with a full pool, a bootstrap server, each process with its own engine
(:mod:`sglang_cp_hicache.testing.v0_5_12.pd_harness`). What every test reads is checked on
the decode side, byte for byte: both sides report Success even when every page is wrong, so
only the bytes tell (the planted controls below prove it). Each cluster runs once per
module (memoized), whatever order the tests run in; the negative controls ride in the
serving clusters (their last requests, re-checked apart on the decode).
"""

from __future__ import annotations

import functools
import os
import time
from typing import Any, Dict, Tuple

import pytest

from sglang_cp_hicache.testing.pd.cluster import (
    decode_killed_problems,
    prefill_names,
    prefill_startup_failure,
    run_fault_cluster,
    run_pd_cluster,
)
from sglang_cp_hicache.testing.pd.roles import free_port, PDCluster, PDEnv, RoleFailed
from sglang_cp_hicache.testing.pd.scenario import EvictDevice, PDRequest
from sglang_cp_hicache.testing.v0_5_12.pd_harness.line import LINE
from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import PDScenario

PS = 64
RUN_TIMEOUT_S = 150.0
KV_BYTES_PER_PAGE_LAYER = PS * 576 * 2  # bf16 MLA latent + rope
INDEX_BYTES_PER_PAGE_LAYER = PS * 132  # fp8 indexer K + fp32 scale

H = tuple(range(1000, 1000 + 5 * PS + 10))  # goes to host, comes back by load-back
D = tuple(range(30000, 30000 + 4 * PS + 3))  # stays on device

SERVED = ("fresh-chunked", "fresh", "host-hit", "device-hit")
#: The negative controls (fresh tokens, served after every clean request): one whole
#: prefill, one chunked.
PLANTED = (
    PDRequest("planted", tuple(range(40000, 40000 + 4 * PS + 3)), room=105),
    PDRequest("planted-chunked", tuple(range(45000, 45000 + 5 * PS + 10)), room=106, chunk_tokens=3 * PS),
)
#: The bug planted in each non-draft serving cluster's negative controls.
PLANT_AT = {2: "wrong_owner", 4: "rank_skips_send"}


def _serving_steps(unreachable_port: int = None, planted: bool = False) -> Tuple[Any, ...]:
    """(c) a fresh chunked prefill (chunks end mid-page), everything evicted to host, a fresh
    prefill, (b) a request whose prefix is loaded back from host, (a) a device hit; with
    ``planted``, the negative controls last."""
    steps = []
    if unreachable_port is not None:  # decode only: a bootstrap address nobody serves
        steps.append(PDRequest("unreachable", D, room=100, bootstrap_port=unreachable_port))
    steps += [
        PDRequest("fresh-chunked", H, room=101, chunk_tokens=2 * PS + 37),
        EvictDevice(),
        PDRequest("fresh", D, room=102),
        PDRequest("host-hit", H[: 4 * PS] + tuple(range(50000, 50000 + PS + 5)), room=103),
        PDRequest("device-hit", D[: 3 * PS] + tuple(range(60000, 60000 + 2 * PS + 7)), room=104),
    ]
    return tuple(steps) + (PLANTED if planted else ())


@functools.lru_cache(maxsize=None)
def _served(cp: int, draft: bool) -> Dict[str, Any]:
    unreachable = free_port() if (cp, draft) == (2, False) else None
    plants = () if draft else tuple((spec.rid, PLANT_AT[cp]) for spec in PLANTED)
    steps = _serving_steps(unreachable, planted=bool(plants))
    results = run_pd_cluster(LINE, PDScenario(cp_size=cp, steps=steps, draft=draft, plants=plants), RUN_TIMEOUT_S)
    results["unreachable_port"] = unreachable
    return results


def _by_rid(outcomes) -> Dict[str, Any]:
    return {o.rid: o for o in outcomes}


GRID = [(2, False), (4, False), (2, True), (4, True)]
GRID_IDS = [f"cp{cp}{'-mtp' if draft else ''}" for cp, draft in GRID]


@pytest.mark.parametrize("cp,draft", GRID, ids=GRID_IDS)
def test_decode_pool_holds_the_logical_kv_of_every_token(cp, draft):
    run = _served(cp, draft)
    report = run["decode"]
    served = [o for o in report.outcomes if o.rid in SERVED]
    assert [o.rid for o in served] == list(SERVED)
    for o in served:
        assert o.success, o.failure
        assert (o.kv_mismatches, o.draft_mismatches) == (0, 0), o
        assert o.aux_ok, f"{o.rid}: first output token / MTP hidden state not as prefill set them"
    # Re-checked after every transfer: no later transfer overwrote an earlier request.
    assert (report.final_kv_mismatches, report.final_draft_mismatches) == (0, 0)


@pytest.mark.parametrize("cp,draft", GRID, ids=GRID_IDS)
def test_no_page_lands_outside_what_the_decode_granted(cp, draft):
    assert _served(cp, draft)["decode"].off_grant_pages_changed == 0


@pytest.mark.parametrize("cp,draft", GRID, ids=GRID_IDS)
def test_prefixes_came_from_device_host_and_chunked_prefill(cp, draft):
    for name in prefill_names(cp):
        outcomes = _by_rid(_served(cp, draft)[name])
        assert outcomes["fresh-chunked"].chunks == 3  # forwards end at 128 | 293 (mid-page) | 330
        assert outcomes["host-hit"].host_hit_tokens == 4 * PS  # loaded back, device wiped before
        assert outcomes["device-hit"].device_hit_tokens == 3 * PS
        assert outcomes["fresh"].device_hit_tokens == outcomes["fresh"].host_hit_tokens == 0


@pytest.mark.parametrize("cp,draft", GRID, ids=GRID_IDS)
def test_each_rank_sends_exactly_the_pages_it_owns(cp, draft):
    """Bytes handed to each rank's engine are its owned pages' KV + indexer bytes (target
    and draft); over all ranks, every page of every request exactly once."""
    layers = 2 + (1 if draft else 0)
    page_bytes = layers * (KV_BYTES_PER_PAGE_LAYER + INDEX_BYTES_PER_PAGE_LAYER)
    run = _served(cp, draft)
    for rid, tokens in (("fresh-chunked", len(H)), ("fresh", len(D))):
        per_rank = [_by_rid(run[name])[rid] for name in prefill_names(cp)]
        assert [o.payload_bytes for o in per_rank] == [o.owned_pages * page_bytes for o in per_rank]
        assert sum(o.owned_pages for o in per_rank) == -(-tokens // PS)


@pytest.mark.parametrize("cp,draft", GRID, ids=GRID_IDS)
def test_prefill_pools_and_host_tier_unchanged_and_nothing_leaks(cp, draft):
    run = _served(cp, draft)
    planted = [] if draft else [spec.rid for spec in PLANTED]
    for name in prefill_names(cp):
        assert [o.rid for o in run[name]] == list(SERVED) + planted
        for o in run[name]:
            assert o.success, f"{name} {o.rid}: {o.failure}"
            assert o.pools_unchanged, f"{name} {o.rid}: the send changed this rank's pools or host tier"
            assert o.leaked == [], f"{name} {o.rid}: {o.leaked}"
    assert run["all_ended"]


def test_unreachable_bootstrap_fails_naming_it_and_decode_serves_on():
    run = _served(2, False)
    unreachable = _by_rid(run["decode"].outcomes)["unreachable"]
    address = f"127.0.0.1:{run['unreachable_port']}"
    assert not unreachable.success
    assert any(address in message for message in unreachable.errors_logged), unreachable.errors_logged
    assert unreachable.granted_pages == 0  # refused before any page was allocated
    assert all(o.success for o in run["decode"].outcomes if o.rid != "unreachable")


# ------------------------------------------------------------------ negative controls
@pytest.mark.parametrize("cp", [2, 4], ids=[f"cp{cp}-{PLANT_AT[cp]}" for cp in (2, 4)])
def test_planted_filter_bug_fails_the_byte_check_not_the_status(cp):
    """cp 2: each rank sends the next rank's lane from its own slots; cp 4: the last rank
    sends no pages. Both sides report Success; only the decode's bytes tell, at once and in
    the end-of-run re-check."""
    run = _served(cp, False)
    rids = [spec.rid for spec in PLANTED]
    outcomes = [o for o in run["decode"].outcomes if o.rid in rids]
    assert [o.rid for o in outcomes] == rids
    assert all(o.success for o in outcomes)  # both sides report Success ...
    assert all(_by_rid(run[name])[rid].success for name in prefill_names(cp) for rid in rids)
    assert all(o.kv_mismatches > 0 for o in outcomes)  # ... only the bytes are wrong
    assert run["decode"].final_planted_kv_mismatches > 0
    assert run["decode"].off_grant_pages_changed == 0  # wrong bytes, still in granted slots


# ------------------------------------------------------------------ faults
KILLED = PDRequest("killed", tuple(range(70000, 70000 + 9 * PS + 10)), room=401, chunk_tokens=2 * PS)
NO_ENV = PDRequest("no-env", tuple(range(80000, 80000 + 3 * PS + 1)), room=402)
NEXT = PDRequest("next", tuple(range(90000, 90000 + 3 * PS + 10)), room=403)
# The decodes are up before the first request (run_fault_cluster): the bootstrap timeout
# bounds the metadata's way only, and no-env's failure waits it out.
FAULT_PREFILL_ENV = PDEnv(bootstrap_timeout_s=5)
NO_ENV_DECODE = PDEnv(all_cp_ranks_transfer=False, waiting_timeout_s=5)


@functools.lru_cache(maxsize=None)
def _faults() -> Dict[str, Any]:
    """cp 2. decode-a dies after the killed request's first chunk went out (the prefill
    ranks wait at their checkpoint meanwhile); decode-b runs without
    SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER; decode-c serves the next request."""
    scenario = PDScenario(cp_size=2, steps=(KILLED, NO_ENV, NEXT), pause_after_chunk="killed")
    rids = (KILLED.rid, NO_ENV.rid, NEXT.rid)
    return run_fault_cluster(LINE, scenario, rids, FAULT_PREFILL_ENV, NO_ENV_DECODE, RUN_TIMEOUT_S)


def test_decode_killed_mid_transfer_fails_the_request_frees_it_and_serves_the_next():
    run = _faults()
    assert decode_killed_problems(run, (KILLED.rid, NO_ENV.rid, NEXT.rid), 2) == []



def test_decode_without_all_cp_ranks_transfer_fails_loudly_never_with_wrong_kv():
    """Such a decode asks CP rank 0 only; the other ranks never get its metadata, so the
    request fails on both sides by timeout, and not one byte lands in decode's pool."""
    run = _faults()
    received = _by_rid(run["decode-b"].outcomes)["no-env"]
    assert not received.success
    assert "timed out" in received.failure or any("timed out" in m for m in received.errors_logged), received
    assert received.granted_pages > 0 and received.granted_pages_touched == 0
    assert run["decode-b"].off_grant_pages_changed == 0
    for name in prefill_names(2):
        sent = _by_rid(run[name])["no-env"]
        assert not sent.success and sent.leaked == []
    assert any("timed out" in _by_rid(run[name])["no-env"].failure for name in prefill_names(2))
    assert run["all_ended"]


# ------------------------------------------------------------------ the harness itself
def _raising_role(channel):
    raise ValueError("planted role failure")


def _silent_exit_role(channel):
    os._exit(3)  # what a crashed or killed process does: no report


def _hanging_role(channel):
    time.sleep(3600)


def test_harness_names_a_role_that_raises_or_dies_and_ends_every_process():
    with PDCluster(lifetime_s=60) as cluster:
        cluster.start("raises", _raising_role)
        cluster.start("dies", _silent_exit_role)
        hanging = cluster.start("hangs", _hanging_role)
        with pytest.raises(RoleFailed, match="raises raised:(.|\n)*planted role failure"):
            cluster.results(["raises"], 60)
        with pytest.raises(RoleFailed, match="dies: exited with code 3 without reporting"):
            cluster.results(["dies"], 60)
        with pytest.raises(RoleFailed, match=r"no result from \['hangs'\] within 1 s"):
            cluster.results(["hangs"], 1)
    assert hanging.process.exitcode is not None  # killed by close(), never left running


def test_prefill_with_its_bootstrap_unreachable_stops_at_startup_naming_it():
    """The prefill ranks register with a bootstrap address nobody serves: under the flag
    each rank's KV manager stops its startup within a bounded time with an error naming
    host:port (upstream alone retries ~15 s, logs "Connection refused" without the address,
    then serves on unregistered, every request failing later by timeout)."""
    scenario = PDScenario(cp_size=2, steps=())
    failure = prefill_startup_failure(LINE, scenario, RUN_TIMEOUT_S, registration_wait_s=2)
    assert "PDBootstrapUnreachable: PD prefill: bootstrap server 127.0.0.1:" in failure, failure
    assert "did not accept a connection within 2 s" in failure, failure
