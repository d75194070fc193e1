"""PD transfer of natively sharded KV (0.5.23) over a real Mooncake transfer engine (loopback TCP).

cp prefill rank processes (upstream 0.5.23's real sharded stack with the plugin's flag, under
upstream's own PD prefill code), one cp-1 decode process with a full pool, a bootstrap
server, each process with its own engine (:mod:`sglang_cp_hicache.testing.v0_5_23.pd_harness`).
Upstream owner-filters the send itself (``filter_kv_indices_for_shard_rank``); what every test
reads is checked on the decode side, byte for byte: both sides report Success even when the
pages are wrong, so only the bytes tell (the planted controls prove it). Each cluster runs
once per module (memoized), whatever order the tests run in.
"""

from __future__ import annotations

import functools
from typing import Any, Dict, Tuple

import pytest

from sglang_cp_hicache.testing.pd.cluster import (
    decode_killed_problems,
    prefill_names,
    prefill_startup_failure,
    run_fault_cluster,
    run_pd_cluster,
)
from sglang_cp_hicache.testing.pd.roles import free_port, PDEnv
from sglang_cp_hicache.testing.pd.scenario import EvictDevice, PDRequest
from sglang_cp_hicache.testing.v0_5_23.pd_harness.line import LINE
from sglang_cp_hicache.testing.v0_5_23.pd_harness.scenario import PDScenario

PS = 64
RUN_TIMEOUT_S = 150.0
PAGE_LAYER_BYTES = PS * 576 * 2 + PS * 132  # bf16 MLA KV + DSA indexer K/scale of one page-layer
PAGE_BYTES = 2 * PAGE_LAYER_BYTES  # the target's 2 layers
DRAFT_PAGE_BYTES = 3 * PAGE_LAYER_BYTES  # with the MTP draft's layer

H = tuple(range(1000, 1000 + 5 * PS + 10))  # goes to host, comes back by load-back
D = tuple(range(30000, 30000 + 4 * PS + 3))  # stays on device


SERVED = ("fresh-chunked", "fresh", "host-hit", "device-hit")
PLANTED_RID = "planted"
#: The negative control planted in each serving cluster (one request, the last).
PLANT_AT = {2: "wrong_owner", 4: "rank_skips_send"}


def _serving_steps(unreachable_port: int = None) -> Tuple[Any, ...]:
    """(c) a fresh chunked prefill (the last chunk ends mid-page), everything evicted to host, a
    fresh prefill, (b) a prefix loaded back from host, (a) a device hit; then the planted
    request (a negative control, chunked)."""
    steps = []
    if unreachable_port is not None:  # decode only: a bootstrap address nobody serves
        steps.append(PDRequest("unreachable", D, room=100, bootstrap_port=unreachable_port))
    steps += [
        PDRequest("fresh-chunked", H, room=101, chunk_tokens=2 * PS + 37),
        EvictDevice(),
        PDRequest("fresh", D, room=102),
        PDRequest("host-hit", H[: 4 * PS] + tuple(range(50000, 50000 + PS + 5)), room=103),
        PDRequest("device-hit", D[: 3 * PS] + tuple(range(60000, 60000 + 2 * PS + 7)), room=104),
        PDRequest(PLANTED_RID, tuple(range(40000, 40000 + 5 * PS + 20)), room=105, chunk_tokens=3 * PS),
    ]
    return tuple(steps)


@functools.lru_cache(maxsize=None)
def _served(cp: int) -> Dict[str, Any]:
    unreachable = free_port() if cp == 2 else None
    scenario = PDScenario(cp_size=cp, steps=_serving_steps(unreachable), plants=((PLANTED_RID, PLANT_AT[cp]),))
    results = run_pd_cluster(LINE, scenario, RUN_TIMEOUT_S)
    results["unreachable_port"] = unreachable
    return results


def _by_rid(outcomes) -> Dict[str, Any]:
    return {o.rid: o for o in outcomes}


def _request(rid: str) -> PDRequest:
    return next(s for s in _serving_steps() if isinstance(s, PDRequest) and s.rid == rid)


CPS = [2, 4]


@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}" for cp in CPS])
def test_decode_pool_holds_the_logical_kv_and_indexer_of_every_token(cp):
    report = _served(cp)["decode"]
    served = [o for o in report.outcomes if o.rid in SERVED]
    assert [o.rid for o in served] == list(SERVED)
    for o in served:
        assert o.success, o.failure
        assert o.kv_mismatches == 0, o
        assert o.aux_ok, f"{o.rid}: the first output token did not arrive as prefill set it"
    # Re-checked after every transfer: no later transfer overwrote an earlier request.
    assert report.final_kv_mismatches == 0


@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}" for cp in CPS])
def test_no_page_lands_outside_what_the_decode_granted(cp):
    assert _served(cp)["decode"].off_grant_pages_changed == 0


@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}" for cp in CPS])
def test_prefixes_came_from_device_host_and_chunked_prefill(cp):
    for name in prefill_names(cp):
        outcomes = _by_rid(_served(cp)[name])
        assert outcomes["fresh-chunked"].chunks == 3  # forwards end at 128 | 256 | 330 (pages under sharding)
        assert outcomes["host-hit"].host_hit_tokens == 4 * PS  # loaded back, device wiped before
        assert outcomes["host-hit"].device_hit_tokens == 0
        assert outcomes["device-hit"].device_hit_tokens == 3 * PS
        assert outcomes["fresh"].device_hit_tokens == outcomes["fresh"].host_hit_tokens == 0


@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}" for cp in CPS])
def test_each_rank_sends_exactly_its_owned_pages_about_one_cp_th(cp):
    """Each rank's engine got exactly its owned pages' KV + indexer bytes; over the ranks,
    every page of every request once; each rank floor or ceil of a request's pages / cp
    (one request balanced to a page: a chain's pages rotate over the owners)."""
    run = _served(cp)
    for rid in SERVED:
        per_rank = [_by_rid(run[name])[rid] for name in prefill_names(cp)]
        assert [o.payload_bytes for o in per_rank] == [o.owned_pages * PAGE_BYTES for o in per_rank]
        pages = sum(o.owned_pages for o in per_rank)
        assert pages == -(-len(_request(rid).token_ids) // PS)
        assert {o.owned_pages for o in per_rank} <= {pages // cp, -(-pages // cp)}, (rid, per_rank)


@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}" for cp in CPS])
def test_prefill_pools_and_host_tier_unchanged_and_nothing_leaks(cp):
    run = _served(cp)
    for name in prefill_names(cp):
        assert [o.rid for o in run[name]] == list(SERVED) + [PLANTED_RID]
        for o in run[name]:
            assert o.success, f"{name} {o.rid}: {o.failure}"
            assert o.pools_unchanged, f"{name} {o.rid}: the send changed this rank's pool or host tier"
            assert o.leaked == [], f"{name} {o.rid}: {o.leaked}"
    assert run["all_ended"]


def test_unreachable_bootstrap_fails_naming_it_and_decode_serves_on():
    run = _served(2)
    unreachable = _by_rid(run["decode"].outcomes)["unreachable"]
    address = f"127.0.0.1:{run['unreachable_port']}"
    assert not unreachable.success
    assert any(address in message for message in unreachable.errors_logged), unreachable.errors_logged
    assert unreachable.granted_pages == 0  # refused before any page was allocated
    assert all(o.success for o in run["decode"].outcomes if o.rid != "unreachable")


# ------------------------------------------------------------------ negative controls
@pytest.mark.parametrize("cp", CPS, ids=[f"cp{cp}-{PLANT_AT[cp]}" for cp in CPS])
def test_planted_owner_filter_bug_fails_the_byte_check_not_the_status(cp):
    """cp 2: each rank sends the next rank's lane from its own rows; cp 4: the last rank
    sends no pages. Both sides report Success; only the decode's bytes tell."""
    run = _served(cp)
    planted = _by_rid(run["decode"].outcomes)[PLANTED_RID]
    assert planted.success and all(_by_rid(run[name])[PLANTED_RID].success for name in prefill_names(cp))
    assert planted.kv_mismatches > 0
    assert run["decode"].final_planted_kv_mismatches > 0  # the end-of-run re-check sees it too
    assert run["decode"].off_grant_pages_changed == 0  # wrong bytes, still in granted slots


# ------------------------------------------------------------------ faults
KILLED = PDRequest("killed", tuple(range(70000, 70000 + 9 * PS + 10)), room=401, chunk_tokens=2 * PS)
# With the MTP draft on: a fresh chunked prefill, then a device hit on its prefix.
NO_ENV = PDRequest("no-env", tuple(range(80000, 80000 + 4 * PS + 9)), room=402, chunk_tokens=2 * PS + 5)
NEXT = PDRequest("next", NO_ENV.token_ids[: 3 * PS] + tuple(range(90000, 90000 + 2 * PS + 10)), room=403)
FAULT_PREFILL_ENV = PDEnv(bootstrap_timeout_s=12)
NO_ENV_DECODE = PDEnv(all_cp_ranks_transfer=False)


@functools.lru_cache(maxsize=None)
def _faults() -> Dict[str, Any]:
    """cp 2 with the MTP draft on. decode-a dies after the killed request's first chunk went
    out (the prefill ranks wait at their checkpoint meanwhile); decode-b runs without
    SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER; decode-c serves the next request (a device
    hit on no-env's prefix)."""
    scenario = PDScenario(cp_size=2, steps=(KILLED, NO_ENV, NEXT), pause_after_chunk="killed", draft=True)
    rids = (KILLED.rid, NO_ENV.rid, NEXT.rid)
    return run_fault_cluster(LINE, scenario, rids, FAULT_PREFILL_ENV, NO_ENV_DECODE, RUN_TIMEOUT_S)


def test_decode_killed_mid_transfer_fails_the_request_frees_it_and_serves_the_next():
    run = _faults()
    assert decode_killed_problems(run, (KILLED.rid, NO_ENV.rid, NEXT.rid), 2) == []
    assert run["all_ended"]


def test_decode_without_all_cp_ranks_transfer_still_pulls_every_rank_byte_exact():
    """0.5.23's prefill registers ``enable_kv_cache_sharding`` with the bootstrap server and
    a decode pulls from every CP rank of such a prefill whatever its env
    (``common/conn.py`` ``_resolve_rank_mapping``): the request succeeds with the right KV,
    never silently with rank 0's pages only."""
    run = _faults()
    received = _by_rid(run["decode-b"].outcomes)["no-env"]
    assert received.success, received.failure
    assert (received.kv_mismatches, received.draft_mismatches) == (0, 0) and received.aux_ok
    assert run["decode-b"].off_grant_pages_changed == 0
    for name in prefill_names(2):
        sent = _by_rid(run[name])["no-env"]
        assert sent.success and sent.leaked == [] and sent.payload_bytes == sent.owned_pages * DRAFT_PAGE_BYTES


def test_mtp_draft_kv_of_a_chunked_prefill_and_a_device_hit_lands_byte_exact():
    """(d) With the MTP draft's sharded one-layer pool beside the target (upstream's
    ``num_draft_entries``): target KV, indexer, draft KV and draft indexer of every token,
    and the draft's hidden state; each rank sends its owned pages of all three layers."""
    run = _faults()
    for decode, rid in (("decode-b", "no-env"), ("decode-c", "next")):
        received = _by_rid(run[decode].outcomes)[rid]
        assert received.success and (received.kv_mismatches, received.draft_mismatches) == (0, 0), received
        assert received.aux_ok, f"{rid}: output token / MTP hidden state not as prefill set them"
        assert (run[decode].final_kv_mismatches, run[decode].final_draft_mismatches) == (0, 0)
    for name in prefill_names(2):
        outcomes = _by_rid(run[name])
        assert outcomes["no-env"].chunks == 3  # 128 | 256 | 265
        assert outcomes["next"].device_hit_tokens == 3 * PS
        for rid in ("no-env", "next"):
            assert outcomes[rid].payload_bytes == outcomes[rid].owned_pages * DRAFT_PAGE_BYTES
            assert outcomes[rid].pools_unchanged and outcomes[rid].leaked == []


def test_prefill_with_its_bootstrap_unreachable_stops_at_startup_naming_it():
    """The prefill ranks register with a bootstrap address nobody serves: under the flag
    each rank's KV manager stops its startup within a bounded time with an error naming
    host:port (upstream alone retries ~15 s, then serves on unregistered, every request
    failing later by timeout)."""
    scenario = PDScenario(cp_size=2, steps=())
    failure = prefill_startup_failure(LINE, scenario, RUN_TIMEOUT_S, registration_wait_s=2)
    assert "PDBootstrapUnreachable: PD prefill: bootstrap server 127.0.0.1:" in failure, failure
    assert "did not accept a connection within 2 s" in failure, failure
