"""The serving scenarios: request sequences against a :class:`ServingSession`, each request
answered by the sharded prefill's router and by its unsharded reference's, compared token by
token (output ids equal, logprobs bit for bit), with what each scenario must show checked from
SGLang's own response fields (cached tokens per tier), metrics and logs.

Every scenario uses prompts of its own (token ids from a label), so scenarios run in any
order against one cluster; each returns a :class:`ScenarioReport` and never raises for a
difference (the report carries it).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

from sglang_cp_hicache.testing.server import bench_scenario
from sglang_cp_hicache.testing.server.cache_metrics_check import L2_SERIES, CacheMetricsWindow, storage_hit_on_both
from sglang_cp_hicache.testing.server.client import Completion, RequestFailed, generate, post
from sglang_cp_hicache.testing.server.eagle_scenario import eagle
from sglang_cp_hicache.testing.server.eagle_tiers import eagle_tiers
from sglang_cp_hicache.testing.server.fleet import fleet_shared_l3
from sglang_cp_hicache.testing.server.fleet_faults import fleet_faults
from sglang_cp_hicache.testing.server.cluster import Router, Server
from sglang_cp_hicache.testing.server.input_scenarios import bad_input, batch_of_300, flush_after_warm_up
from sglang_cp_hicache.testing.server.kv_events_check import check_kv_events
from sglang_cp_hicache.testing.server.launch import (
    CHUNKED_PREFILL_SIZE,
    CONTEXT_LENGTH,
    LOGICAL_TOKENS,
    PAGE_SIZE,
    LineLaunch,
    PrefillSpec,
    StorageSpec,
)
from sglang_cp_hicache.testing.server.plugin_metrics_check import check_plugin_metrics
from sglang_cp_hicache.testing.server.recorder import (
    FIRST_TOKEN_ID,
    MAX_NEW,
    VOCAB_SIZE,
    Recorder,
    ScenarioReport,
    files_under,
    flush,
    full_pages,
    in_flight,
    phase,
    taken,
    tokens,
    wait_settled,
)
from sglang_cp_hicache.testing.server.session import ServingSession
from sglang_cp_hicache.testing.server.soak import soak_short
from sglang_cp_hicache.testing.server.two_nodes import two_nodes

logger = logging.getLogger(__name__)

INDEX_TOPK = 128
FAULT_ANSWER_S = 60.0  # a request whose decode died must be answered within this
LANE_EVICTION_LOG = "cp_hicache extend: device lanes"
OWN_PREFIX_KEY = "serving-harness-own-prefix"


# ---------------------------------------------------------------------- scenarios
def device_prefix_hit(session: ServingSession) -> ScenarioReport:
    """A prompt, then the same prompt extended: its full pages come from the device pool."""
    rec = Recorder(session, "device prefix hit")
    prompt = tokens("device", 6 * PAGE_SIZE + 10)
    rec.pair("cold", prompt, cold=True)
    a, _ = rec.pair("extended", prompt + tokens("device:more", 40))
    if a is not None:
        rec.expect(a.tier("device") >= full_pages(len(prompt)), f"device hit {a.cached_by_tier}, want >= {full_pages(len(prompt))}")
    return rec.finish()


def host_load_back(session: ServingSession) -> ScenarioReport:
    """A prompt, fillers past the logical device capacity, then the prompt again: its pages
    come back from host memory (HiCache load-back)."""
    rec = Recorder(session, "host load-back")
    compared = session.line.upstream_cache_metrics_compared  # both flushed first: trees alike
    window = CacheMetricsWindow(rec, session.sharded, session.reference, L2_SERIES).open(True) if compared else None
    prompt = tokens("host", 12 * PAGE_SIZE)
    rec.pair("cold", prompt, cold=True)
    filler_tokens = 25 * PAGE_SIZE  # three fill the logical pool past its capacity
    for i in range(LOGICAL_TOKENS // filler_tokens + 1):
        rec.pair(f"filler {i}", tokens(f"host:filler:{i}", filler_tokens))
    a, _ = rec.pair("revisit", prompt + tokens("host:more", 30))
    if a is not None:
        rec.expect(a.tier("host") > 0, f"no host hit on the revisit: {a.cached_by_tier}")
    if window is not None:
        window.close(host_gauges=True)
    return rec.finish()


def chunked_prefill(session: ServingSession) -> ScenarioReport:
    """Prompts longer than the chunked-prefill size, cold and over a cached prefix."""
    rec = Recorder(session, "chunked prefill")
    prompt = tokens("chunked", 2 * CHUNKED_PREFILL_SIZE + 3 * PAGE_SIZE + 17)
    rec.pair("cold", prompt, cold=True)
    a, _ = rec.pair("extended", prompt + tokens("chunked:more", CHUNKED_PREFILL_SIZE + 5))
    if a is not None:
        rec.expect(a.cached_tokens > CHUNKED_PREFILL_SIZE, f"cached {a.cached_tokens} <= one chunk")
    return rec.finish()


def sparse_selection(session: ServingSession) -> ScenarioReport:
    """Prompts longer than ``index_topk``: the indexer selects a subset of the keys."""
    rec = Recorder(session, "sparse selection (> index_topk)")
    rec.pair("just over", tokens("sparse:a", INDEX_TOPK + 3), cold=True)
    long = tokens("sparse:b", 7 * INDEX_TOPK + 11)
    rec.pair("7x topk", long, cold=True)
    rec.pair("extend over a cached prefix", long + tokens("sparse:b:more", INDEX_TOPK + 9))
    return rec.finish()


def lane_pressure(session: ServingSession) -> ScenarioReport:
    """New three-page prompts until the device pool is full and every extend must evict:
    the sharded server makes room on the short owner lanes only (its lane planner's
    decisions appear in its log), and every answer matches the reference."""
    rec = Recorder(session, "device pressure on owner lanes")
    mark = session.sharded.log_lines()
    before = session.sharded.metrics() if session.line.plugin_metrics else None
    # enough three-page prompts to fill the logical pool, then a few that must evict
    count = LOGICAL_TOKENS // (3 * PAGE_SIZE) + 3
    prompts = [tokens(f"lanes:{i}", 3 * PAGE_SIZE + 5) for i in range(count)]
    for i, prompt in enumerate(prompts):
        rec.pair(f"prompt {i}", prompt, cold=i == 0)
    a, _ = rec.pair("revisit of the last prompt", prompts[-1] + tokens("lanes:more", 20))
    if a is not None:
        rec.expect(a.tier("device") >= 3 * PAGE_SIZE, f"the newest prompt left the device: {a.cached_by_tier}")
    if session.line.lane_decisions_logged:
        plans = [line for line in session.sharded.process.log_text().splitlines()[mark:] if LANE_EVICTION_LOG in line]
        rec.expect(bool(plans), "no lane-aware eviction plan in the sharded server's log")
        rec.note(f"{len(plans)} lane-aware eviction plans")
    if before is not None:
        check_plugin_metrics(rec, session, before)
    return rec.finish()


def zero_owned_rank(session: ServingSession) -> ScenarioReport:
    """Extends whose new pages one CP rank owns entirely: the other rank stores, backs up
    and sends none of them (and still acks)."""
    rec = Recorder(session, "new pages on one rank only")
    prefix = tokens("zero", 3 * PAGE_SIZE)
    rec.pair("prefix", prefix, cold=True)
    one_page = prefix + tokens("zero:page", PAGE_SIZE)
    a, _ = rec.pair("one new full page", one_page)
    if a is not None:
        rec.expect(a.tier("device") >= len(prefix), f"prefix not reused: {a.cached_by_tier}")
    rec.pair("one new partial page", one_page + tokens("zero:partial", 17))
    return rec.finish()


def _settle_file_tier(storage: StorageSpec, at_least: int) -> int:
    return wait_settled(lambda: files_under(storage.directory), at_least)


def _storage_hit_like_reference(rec: Recorder, prefill: Server, prompt: List[int], label: str) -> None:
    """``prompt`` extended, after the sharded side's device and host tiers are flushed: its
    pages come from storage there, from the reference's device pool on the other side (the
    same prefix length reused on both, so the same forward shapes: bits can match)."""
    rec.expect(flush(prefill), f"/flush_cache failed on {prefill.name}")
    a, b = rec.pair("after flush", prompt + tokens(f"{label}:more", 25))
    if a is not None and b is not None:
        want = full_pages(len(prompt))
        rec.expect(a.tier("storage") >= want, f"storage hit {a.cached_by_tier}, want {want}")
        rec.expect(b.tier("device") >= want, f"reference device hit {b.cached_by_tier}, want {want}")


def l3_file(session: ServingSession) -> ScenarioReport:
    """The sharded server's L3 file tier: a prompt written to files, its device and host tiers
    flushed, the prompt again: its pages come from storage, answers match the reference."""
    rec = Recorder(session, "L3 file: storage hit")
    storage = session.storage
    prompt = tokens("l3file", 10 * PAGE_SIZE)
    rec.pair("cold", prompt, cold=True)
    files = _settle_file_tier(storage, 1)
    rec.expect(files > 0, f"no L3 files under {storage.directory}")
    _storage_hit_like_reference(rec, session.sharded, prompt, "l3file")
    if session.line.upstream_cache_metrics_compared:
        storage_hit_on_both(rec, session.sharded, prompt, "l3file")
    return rec.finish()


def l3_file_restart(session: ServingSession) -> ScenarioReport:
    """The sharded server's L3 files read after a restart, by two prefills started on them
    together (owner-free keys, every rank reading its own pages):

    * a fresh sharded prefill of the same CP size: its storage hit answers exactly as the
      reference does over the same prefix on its device;
    * a one-rank prefill with the flag (``--tp 1``, CP size 1): over the sharded server's
      pages it answers with the same ids as over a prefix it computed itself (an
      ``extra_key`` keeps that prefix apart from every tier's pages of the sharded server);
      the logprobs differ by what a TP 2 and a TP 1 forward differ in the KV they write
      (measured here on one prompt through the same decode server), which no reader can
      remove: reported. Its own pages round-trip through the files exactly."""
    rec = Recorder(session, "L3 file: read after a restart")
    storage = session.storage
    prompt = tokens("restart", 9 * PAGE_SIZE)
    written, _ = rec.pair("written by the sharded server", prompt, cold=True)
    _settle_file_tier(storage, 1)
    servers, routers, times = session.behind_routers(
        PrefillSpec("sharded-restarted", tp=session.tp, storage=storage),
        PrefillSpec("reader-tp1", tp=1, storage=storage),
    )
    try:
        rec.note("restarted servers ready in " + ", ".join(f"{s.name} {times[s.name]:.0f} s" for s in servers))
        request = prompt + tokens("restart:more", 21)
        rec.sharded = routers[0]
        a, b = rec.pair("read after the restart", request)
        rec.sharded = session.sharded_router
        want = full_pages(len(prompt))
        if a is not None and b is not None:
            rec.expect(a.tier("storage") >= want, f"restarted server's storage hit {a.cached_by_tier}, want {want}")
            rec.expect(b.tier("device") >= want, f"reference device hit {b.cached_by_tier}, want {want}")
        _one_rank_reader(rec, routers[1], servers[1], prompt, request, written)
    finally:
        rec.sharded = session.sharded_router
        session.retire(*routers, *servers)
    return rec.finish()


def _one_rank_reader(rec: Recorder, router: Router, reader: Server, prompt: List[int], request: List[int], written: Optional[Completion]) -> None:
    want = full_pages(len(prompt))
    hit = rec.ask(router, "cp 1 reader: storage hit", request)
    cold = rec.ask(router, "cp 1 reader: own prefix, cold", prompt, extra_key=OWN_PREFIX_KEY)
    own = rec.ask(router, "cp 1 reader: own prefix reused", request, extra_key=OWN_PREFIX_KEY)
    if None not in (written, hit, cold, own):
        rec.expect(hit.tier("storage") >= want, f"cp 1 reader's storage hit {hit.cached_by_tier}, want {want}")
        rec.expect(cold.cached_tokens == 0, f"the extra_key request hit a cache: {cold.cached_by_tier}")
        rec.expect(own.tier("device") >= want, f"cp 1 reader's own prefix not reused: {own.cached_by_tier}")
        rec.expect(hit.output_ids == own.output_ids, f"cp 1 reader: ids over the sharded pages {hit.output_ids} != over its own {own.output_ids}")
        rec.note(f"cp 1 reader: TP 2 vs TP 1 KV, same prompt through one decode: logprobs differ by up to {_max_diff(written, cold):.3g}")
        rec.note(f"cp 1 reader: over the sharded pages vs its own: logprobs differ by up to {_max_diff(hit, own):.3g}")
    own_prompt = tokens("restart:own", 5 * PAGE_SIZE)
    extended = own_prompt + tokens("restart:own:more", 19)
    rec.ask(router, "cp 1 reader's own prompt", own_prompt)
    on_device = rec.ask(router, "cp 1 reader's own prompt extended", extended)
    _settle_file_tier(rec.session.storage, 1)
    rec.expect(flush(reader), "/flush_cache failed on the cp 1 reader")
    from_storage = rec.ask(router, "cp 1 reader's own prompt extended, from storage", extended)
    if on_device is not None and from_storage is not None:
        rec.expect(from_storage.tier("storage") >= full_pages(len(own_prompt)), f"cp 1 reader's own storage hit {from_storage.cached_by_tier}")
        rec.compare("cp 1 reader's own pages round trip", from_storage, on_device)


def _max_diff(a: Completion, b: Completion) -> float:
    return max((abs(x - y) for x, y in zip(a.logprobs, b.logprobs)), default=0.0)


def l3_mooncake(session: ServingSession) -> ScenarioReport:
    """A sharded prefill on the Mooncake store (``page_first`` host pools, a master started by
    the harness): a prompt stored, the device and host tiers flushed, the prompt again: a
    storage hit, answers identical to the unsharded reference."""
    master = session.cluster.mooncake_master()
    storage = StorageSpec("mooncake", mooncake_master=master.address)
    spec = PrefillSpec("sharded-mooncake", tp=session.tp, mem_layout="page_first", storage=storage)
    servers: List[Server] = []
    routers: List[Router] = []
    try:
        servers, routers, times = session.behind_routers(spec)
        server, router = servers[0], routers[0]
        rec = Recorder(session, "L3 Mooncake store: storage hit", sharded=router)
        rec.note(f"Mooncake prefill started in {times[server.name]:.0f} s")
        prompt = tokens("mooncake", 10 * PAGE_SIZE)
        rec.pair("cold", prompt, cold=True)
        keys = wait_settled(master.key_count, 1)
        rec.expect(keys > 0, "the Mooncake master holds no keys")
        rec.note(f"{keys} store objects")
        _storage_hit_like_reference(rec, server, prompt, "mooncake")
        if session.line.upstream_cache_metrics_compared:
            storage_hit_on_both(rec, server, prompt, "mooncake")
        return rec.finish()
    finally:
        session.retire(*routers, *servers, master.process)


def malformed_request(session: ServingSession) -> ScenarioReport:
    """Malformed bodies get a clear HTTP error; the servers keep serving."""
    rec = Recorder(session, "fault: malformed request")
    for label, body in (("not JSON", b"{"), ("input_ids not a list", json.dumps({"input_ids": "abc"}).encode())):
        for router in (session.sharded_router, session.reference_router):
            rec.report.requests += 1
            status, text = post(router.url, "/generate", body)
            rec.expect(400 <= status < 500, f"{label} via {router.name}: HTTP {status} {text[:160]}")
    rec.pair("served after", tokens("malformed:after", 2 * PAGE_SIZE + 3))
    return rec.finish()


def over_context(session: ServingSession) -> ScenarioReport:
    """A prompt over the context length gets a clear HTTP error; the servers keep serving."""
    rec = Recorder(session, "fault: prompt over the context length")
    long = tokens("over", CONTEXT_LENGTH + 50)
    for router in (session.sharded_router, session.reference_router):
        rec.report.requests += 1
        try:
            generate(router.url, long, MAX_NEW, stream=False)
            rec.expect(False, f"{router.name} served a prompt over the context length")
        except RequestFailed as error:
            rec.expect(400 <= error.status < 500, f"{router.name}: {error}")
            rec.expect("context" in error.body.lower() or "length" in error.body.lower(), f"unclear error: {error.body[:200]}")
    rec.pair("served after", tokens("over:after", 2 * PAGE_SIZE + 3))
    return rec.finish()


def decode_killed(session: ServingSession) -> ScenarioReport:
    """The decode server killed while the sharded prefill holds a request past its bootstrap
    (computing or sending it): the router answers with an error in bounded time, the
    sharded prefill frees the request, and (with a new decode) it serves the next request
    as the reference does."""
    rec = Recorder(session, "fault: decode killed mid-request")
    sharded = session.sharded
    used_before = sharded.metrics().total("sglang:kv_used_tokens")
    prompt = tokens("killed", 3 * CHUNKED_PREFILL_SIZE + 7)
    outcome: Dict[str, object] = {}

    def request() -> None:
        start = time.monotonic()
        try:
            outcome["completion"] = generate(
                session.sharded_router.url, prompt, 64, timeout_s=FAULT_ANSWER_S * 2, stream=False
            )
        except RequestFailed as error:
            outcome["error"] = error
        outcome["answered_s"] = time.monotonic() - start

    thread = threading.Thread(target=request, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline and not taken(sharded):
        time.sleep(0.05)
    rec.note(f"killed at: {phase(sharded)}")
    mark = sharded.log_lines()
    session.decode.process.kill()
    thread.join(FAULT_ANSWER_S)
    rec.report.requests += 1
    rec.expect(not thread.is_alive(), f"no answer within {FAULT_ANSWER_S:.0f} s of the decode's death")
    rec.expect("error" in outcome, f"the router answered without an error: {outcome.get('completion')}")
    if "answered_s" in outcome:
        rec.note(f"router answered in {outcome['answered_s']:.1f} s: {str(outcome.get('error'))[:120]}")
    freed = wait_settled(lambda: 0 if in_flight(sharded) else 1, 1, timeout_s=FAULT_ANSWER_S)
    rec.expect(freed == 1, f"the sharded prefill still holds the request: {phase(sharded)}")
    failures = [line for line in sharded.process.log_text().splitlines()[mark:] if "failed for request" in line]
    rec.note(f"the sharded prefill logged {len(failures)} failed transfer(s) (one per rank when killed mid-transfer)")
    used_after = sharded.metrics().total("sglang:kv_used_tokens")
    rec.note(f"device tokens in use {used_before:.0f} before, {used_after:.0f} after (cached pages stay)")
    times = session.restart_decode()
    rec.note(f"decode and routers restarted in {max(times.values()):.0f} s")
    rec.sharded, rec.reference = session.sharded_router, session.reference_router
    rec.pair("served after a new decode", tokens("killed:after", 2 * PAGE_SIZE + 9))
    return rec.finish()



def kv_events(session: ServingSession) -> ScenarioReport:
    """Both prefills' KV event streams over ZMQ: one logical stream equal to the reference's,
    L3 events, cached tokens predicted from them (``kv_events_check.py``)."""
    rec = Recorder(session, "KV events: one stream, predicted hits")
    check_kv_events(rec, session)
    return rec.finish()


GLM5_SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "glm5" / "glm5_pd.py"
GLM5_TIMEOUT_S = 600.0


def glm5_checks(session: ServingSession) -> ScenarioReport:
    """``scripts/glm5``'s own checks, unchanged, against the sharded server's PD cluster in
    their ``--no-launch`` mode: each endpoint healthy, the prefill's hit rates, and the
    repeated-prefix workload (prefixes past the device capacity, revisits from host, probe
    prompts cold / device hit / host hit agreeing), sized for the tiny model by its options."""
    rec = Recorder(session, "scripts/glm5 checks (--no-launch)")
    endpoints = [
        "--no-launch", "--host", "127.0.0.1",
        "--prefill-port", str(session.sharded.endpoint.port),
        "--bootstrap-port", str(session.sharded.endpoint.bootstrap_port),
        "--decode-port", str(session.decode.endpoint.port),
        "--router-port", str(session.sharded_router.endpoint.port),
        "--log-dir", str(session.cluster.run_dir / "glm5"),
    ]  # fmt: skip
    workload = ["--prefix-tokens", str(8 * PAGE_SIZE), "--suffix-tokens", "16", "--rounds", "2",
                "--token-ids", f"{FIRST_TOKEN_ID}:{VOCAB_SIZE}", "--probes", "1"]  # fmt: skip
    for command in (["prefill"], ["decode"], ["router"], ["metrics"], ["repeated-prefix", *workload]):
        rec.report.requests += 1
        try:
            done = subprocess.run(
                [sys.executable, str(GLM5_SCRIPT), *command, *endpoints],
                capture_output=True, text=True, timeout=GLM5_TIMEOUT_S,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            rec.expect(False, f"glm5_pd.py {command[0]} ran past {GLM5_TIMEOUT_S:.0f} s")
            continue
        lines = (done.stdout + done.stderr).strip().splitlines()
        rec.expect(done.returncode == 0, f"glm5_pd.py {command[0]} exited {done.returncode}: {' | '.join(lines[-6:])}")
        rec.note(f"glm5_pd.py {command[0]}: {lines[-1] if lines else '(no output)'}")
    return rec.finish()


@dataclass(frozen=True)
class Scenario:
    name: str
    run: Callable[[ServingSession], ScenarioReport]
    needs_storage: bool = False  # an L3 tier under the flag (a line that admits one)
    needs_refusals: bool = False  # the flag's refusals of unservable requests
    needs_kv_events: bool = False  # the main prefills publish KV events (0.5.23)
    releases: Tuple[str, ...] = ()  # the SGLang releases it runs on (empty: every line)

    def applies_to(self, line: LineLaunch) -> bool:
        storage_ok = not self.needs_storage or line.supports_storage_under_flag
        refusals_ok = not self.needs_refusals or line.refuses_unservable_requests
        events_ok = not self.needs_kv_events or line.publishes_kv_events
        return storage_ok and refusals_ok and events_ok and (not self.releases or line.release in self.releases)


def bench_serving_concurrency(session: ServingSession) -> ScenarioReport:
    """SGLang's ``bench_serving`` at concurrency 4 through the sharded router, the reference
    router and the reference again: no failed request, every answer's tokens, greedy outputs
    within the reference's own spread (``bench_scenario.py``)."""
    rec = Recorder(session, f"bench_serving at concurrency {bench_scenario.CONCURRENCY}: greedy outputs")
    check = bench_scenario.greedy_under_concurrency(
        session.sharded_router, session.reference_router, session.cluster.model, session.cluster.run_dir / "bench"
    )
    rec.report.requests += check.requests
    for side, run in check.runs.items():
        if side in rec.report.cached:
            rec.report.cached[side] = run.hits()
    for problem in check.problems:
        rec.expect(False, problem)
    for note in check.notes:
        rec.note(note)
    return rec.finish()


SCENARIOS: Tuple[Scenario, ...] = (
    Scenario("device_prefix_hit", device_prefix_hit),
    Scenario("host_load_back", host_load_back),
    Scenario("chunked_prefill", chunked_prefill),
    Scenario("sparse_selection", sparse_selection),
    Scenario("lane_pressure", lane_pressure),
    Scenario("zero_owned_rank", zero_owned_rank),
    Scenario("l3_file", l3_file, needs_storage=True),
    Scenario("l3_file_restart", l3_file_restart, needs_storage=True),
    Scenario("l3_mooncake", l3_mooncake, needs_storage=True),
    Scenario("malformed_request", malformed_request),
    Scenario("over_context", over_context),
    Scenario("glm5_checks", glm5_checks),
    Scenario("decode_killed", decode_killed),
    Scenario("bench_serving_concurrency", bench_serving_concurrency, releases=("0.5.23",)),
    Scenario("flush_after_warm_up", flush_after_warm_up, needs_storage=True),
    Scenario("bad_input", bad_input, needs_refusals=True),
    Scenario("batch_of_300", batch_of_300),
    Scenario("soak_short", soak_short, needs_storage=True),
    Scenario("kv_events", kv_events, needs_storage=True, needs_kv_events=True),
)
#: Run only when named (``--scenarios``): their own servers take minutes on 2 cores, more than
#: the serving module's share of CI (docs/serving_on_cpu.md).
BY_HAND: Tuple[Scenario, ...] = (
    Scenario("fleet_shared_l3", fleet_shared_l3, needs_storage=True, releases=("0.5.23",)),
    Scenario("fleet_faults", fleet_faults, needs_storage=True, releases=("0.5.23",)),  # 5 servers started, 2 restarts
    Scenario("eagle", eagle, releases=("0.5.23",)),  # three EAGLE servers: ~4 min, over CI's budget
    Scenario("eagle_tiers", eagle_tiers, needs_storage=True, releases=("0.5.23",)),  # four EAGLE servers
    Scenario("two_nodes", two_nodes, needs_storage=True, releases=("0.5.23",)),  # issue 45: --nnodes 2 on loopback
)
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS + BY_HAND}


def scenarios_for(line: LineLaunch) -> Tuple[Scenario, ...]:
    """The scenarios ``line`` serves (a line that refuses L3 under the flag runs none of it)."""
    return tuple(scenario for scenario in SCENARIOS if scenario.applies_to(line))


__all__ = [
    "BY_HAND",
    "BY_NAME",
    "Recorder",
    "SCENARIOS",
    "Scenario",
    "ScenarioReport",
    "scenarios_for",
    "tokens",
]
