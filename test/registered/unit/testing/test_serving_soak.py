"""The soak's parts that need no server (``testing/server/soak*.py``): the fault schedule
from a seed, conversations that grow by their answers and restart within the context, how
a failed request is classified, the gate the fault injector closes, an idle value settling;
and the harness's extension prebuild (``jit_prebuild.py``) in the run folder. Runs in both
venvs."""

from __future__ import annotations

import importlib.util
import random
import threading
import time

import pytest

from sglang_cp_hicache.testing.server.client import RequestFailed
from sglang_cp_hicache.testing.server.cluster import ServingCluster
from sglang_cp_hicache.testing.server.jit_prebuild import NativeHashPrebuild, PrebuildFailed
from sglang_cp_hicache.testing.server.launch import CONTEXT_LENGTH, PAGE_SIZE, ServerEnv
from sglang_cp_hicache.testing.server.soak import settled
from sglang_cp_hicache.testing.server.soak_faults import KINDS, schedule
from sglang_cp_hicache.testing.server.soak_traffic import (
    ANSWER_BOUND_S,
    MAX_NEW,
    Conversation,
    Gate,
    Tally,
    classify,
    conversations,
)


def test_the_schedule_is_the_seeds_and_covers_every_kind_asked_for():
    twenty = schedule(7, 20.0, KINDS)
    assert twenty == schedule(7, 20.0, KINDS) and twenty != schedule(8, 20.0, KINDS)
    assert {f.kind for f in twenty} == set(KINDS)
    assert [f.at_s for f in twenty] == sorted(f.at_s for f in twenty)
    assert all(0.1 * 1200 <= f.at_s <= 0.8 * 1200 for f in twenty)
    assert sum(f.kind == "decode_kill" for f in twenty) == 4  # 2 per 10 minutes
    short = schedule(42, 1.5, ("abort", "flush"))
    assert sorted(f.kind for f in short) == ["abort", "flush"]  # at least one each


def test_a_conversation_grows_by_its_answers_and_restarts_within_the_context():
    chat = Conversation(0, "sharded", random.Random(1))
    first = chat.next_prompt()
    chat.answered(first, (7, 8))
    second = chat.next_prompt()
    assert second[: len(first) + 2] == first + [7, 8] and len(second) > len(first) + 2
    chat.answered(second, tuple(range(MAX_NEW)))
    while True:
        prompt = chat.next_prompt()
        assert len(prompt) + MAX_NEW < CONTEXT_LENGTH
        if chat.restarts == 2:
            break
        chat.answered(prompt, tuple(range(MAX_NEW)))
    assert chat.turns == 0 and len(prompt) < 2 * PAGE_SIZE + 150  # a system prompt and one turn


def test_conversations_are_spread_over_the_routers():
    made = conversations(3, {"sharded": 2, "reference": 2, "mooncake": 1})
    assert sorted(c.target for c in made) == ["mooncake", "reference", "reference", "sharded", "sharded"]
    assert len({c.key for c in made}) == 5


def test_failures_are_classified_by_status_and_bound():
    assert classify(RequestFailed("HTTP 502", 502), 3.0) == "http_502"
    assert classify(RequestFailed("no answer: ConnectionRefusedError()"), 0.1) == "no_answer"
    assert classify(RequestFailed("no answer: TimeoutError('timed out')"), 10.0) == "hung"
    assert classify(RequestFailed("HTTP 500", 500), ANSWER_BOUND_S) == "hung"


def test_the_tally_counts_and_keeps_the_longest():
    tally = Tally()
    tally.add("turn_sharded_ok", 1.5)
    tally.add("turn_sharded_http_502", 0.5, "HTTP 502: decode gone")
    assert tally.as_dict()["counts"] == {"turn_sharded_http_502": 1, "turn_sharded_ok": 1}
    assert tally.longest_s == 1.5 and tally.failures == ["turn_sharded_http_502: HTTP 502: decode gone"]


def test_the_gate_waits_for_requests_in_flight_and_holds_new_ones():
    gate, stop = Gate(), threading.Event()
    assert gate.enter(stop)
    threading.Timer(0.3, gate.leave).start()
    started = time.monotonic()
    assert gate.close(drain_s=5.0) == 0 and 0.2 < time.monotonic() - started < 3.0
    entered = threading.Event()
    waiter = threading.Thread(target=lambda: gate.enter(stop) and entered.set())
    waiter.start()
    assert not entered.wait(0.3)  # closed: no new request goes out
    gate.open()
    assert entered.wait(2.0)
    waiter.join(2.0)
    gate.leave()
    assert gate.close(drain_s=0.1) == 0


def test_a_value_settles_to_its_idle_one_or_shows_what_stayed():
    values = iter([64, 64, 0, 99])
    assert settled(lambda: next(values), 0, timeout_s=30.0) == 0  # a request that finished
    started = time.monotonic()
    assert settled(lambda: 64, 0, timeout_s=2.5) == 64  # a leaked page stays and is shown
    assert time.monotonic() - started < 10.0


def test_the_cluster_prebuilds_the_page_hash_extension_only_where_the_release_has_it(tmp_path):
    cluster = ServingCluster(tmp_path / "run", tmp_path / "model")
    try:
        has_it = importlib.util.find_spec("sglang.srt.mem_cache.cpp_utils.native_hash") is not None
    except ModuleNotFoundError:  # 0.5.12.post1: no cpp_utils package
        has_it = False
    assert cluster.line.lazy_page_hash_extension is has_it
    assert (cluster.prebuild is not None) is has_it


def test_servers_build_torch_extensions_in_the_run_folder(tmp_path):
    env = ServerEnv(tmp_path / "site", tmp_path / "tmp").plain()
    assert env["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "tmp" / "torch_extensions")
    assert env["TMPDIR"] == str(tmp_path / "tmp")


def test_a_failed_prebuild_names_itself_with_its_log(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")  # the extension cache cannot be made under a file
    env = ServerEnv(tmp_path / "site", tmp_path / "tmp").plain()
    prebuild = NativeHashPrebuild({**env, "TORCH_EXTENSIONS_DIR": str(blocker / "ext")}, tmp_path / "prebuild.log")
    with pytest.raises(PrebuildFailed, match="hicache_hash_cpp build exited 1"):
        prebuild.start().wait(timeout_s=240)
    assert prebuild.start() is prebuild  # started once: no second build
