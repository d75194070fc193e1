"""The fleet scenario's reading of the Mooncake store and of the prefills' logged puts
(``testing/server/store_view.py``), the 0.5.23 runtime step that logs them
(``testing/v0_5_23/server_runtime.puts_logged``) and the fleet routers' command lines (the faults
fleet's health checks), the segment holder's and the prefills' segments. No server: lines
are made by the real logging wrapper around a stand-in put."""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from sglang_cp_hicache.testing.mooncake_master import holder_argv
from sglang_cp_hicache.testing.server.fleet_faults import HEALTH_ARGS, PLAN
from sglang_cp_hicache.testing.server.launch import Endpoint, PrefillSpec, StorageSpec, router_argv
from sglang_cp_hicache.testing.server.store_view import (
    by_page,
    byte_twins,
    component_of,
    logged_puts,
    owner_problems,
    page_of,
    put_by_rank,
)
from sglang_cp_hicache.testing.v0_5_23 import server_runtime
from sglang_cp_hicache.testing.v0_5_23.server_launch import LAUNCH, MOONCAKE_SEGMENT_BYTES

NAMESPACE = "0123456789abcdef"
COMPONENTS = ("_mla_k", "_indexer_mla_k")


def _hash(page: int) -> str:
    return hashlib.sha256(f"page {page}".encode()).hexdigest()


def _keys(page: int) -> list:
    return [f"{NAMESPACE}_{_hash(page)}{suffix}" for suffix in COMPONENTS]


def _logged_put(caplog, keys, results) -> str:
    """The line the runtime step logs for one put batch answered ``results``."""
    put = server_runtime.puts_logged(lambda store, key_strs, *args, **kwargs: results)
    with caplog.at_level(logging.INFO, logger=server_runtime.logger.name):
        assert put(object(), keys, ["ptrs"], ["sizes"]) == results
    return caplog.records[-1].getMessage()


def test_keys_name_their_page_and_component():
    key = _keys(3)[1]
    assert page_of(key) == _hash(3)
    assert component_of(key) == f"{NAMESPACE}_*_indexer_mla_k"
    assert by_page(_keys(1) + _keys(2)) == {_hash(1): set(_keys(1)), _hash(2): set(_keys(2))}


def test_the_runtime_step_logs_every_key_put_and_the_failures_the_store_view_reads(caplog):
    first = _logged_put(caplog, _keys(0) + _keys(2), [0, 0, 0, 0])
    second = _logged_put(caplog, _keys(4) + _keys(2), [0, 0, -900, -900])
    log = f"[TP0] {first}\nunrelated line\n[TP0] {second}\n"
    puts = logged_puts(log)
    assert [(p.rank, len(p.keys), p.failed) for p in puts] == [(0, 4, 0), (0, 4, 2)]
    assert put_by_rank(puts) == {0: _keys(0) + _keys(2) + _keys(4) + _keys(2)}
    assert logged_puts(log, since_line=2)[0].keys == tuple(_keys(4) + _keys(2))


def _two_puts_of_page_2() -> str:
    line = "cp_hicache L3 puts (CPU runtime step): tp rank {} put 2 failed 0: {}"
    return "\n".join(line.format(rank, " ".join(_keys(page))) for rank, page in ((0, 0), (1, 1), (0, 2), (1, 3), (1, 2)))


def test_owner_problems_pass_each_rank_writing_its_own_pages_once():
    stored = {0: _keys(0) + _keys(2), 1: _keys(1) + _keys(3)}
    keys = {key for page in range(4) for key in _keys(page)}
    assert owner_problems(stored, keys, {0: 2, 1: 2}) == []
    assert owner_problems(stored, keys) == []


def test_owner_problems_name_a_single_writer_a_shared_page_a_double_write_and_a_gap():
    keys = {key for page in range(4) for key in _keys(page)}
    everything = [key for page in range(4) for key in _keys(page)]
    assert any("per rank" in p for p in owner_problems({0: everything}, keys, {0: 2, 1: 2}))
    shared = {0: _keys(0) + _keys(2) + _keys(1)[:1], 1: _keys(1)[1:] + _keys(3)}
    assert any("more than one rank" in p for p in owner_problems(shared, keys))
    twice = {0: _keys(0) + _keys(2), 1: _keys(1) + _keys(3) + _keys(3)[:1]}
    assert any("more than once" in p for p in owner_problems(twice, keys))
    assert any("more than once" in p for p in owner_problems(put_by_rank(logged_puts(_two_puts_of_page_2())), keys))
    assert any("the store gained" in p for p in owner_problems({0: _keys(0)}, keys))


def test_byte_twins_pair_objects_by_component_and_bytes():
    first = {key: f"{page}:{key[-8:]}".encode() for page in range(3) for key in _keys(page)}
    twin = {key.replace(_hash(page), _hash(page + 10)): first[key] for page in range(3) for key in _keys(page)}
    assert byte_twins(first, twin) is None
    flipped = dict(twin)
    key = next(iter(flipped))
    flipped[key] = flipped[key][:-1] + bytes([flipped[key][-1] ^ 1])
    assert "no byte-identical twin" in byte_twins(first, flipped)
    assert byte_twins(first, {**twin, key: b""}) == "an object read back empty"


def test_the_fleet_router_takes_every_prefill_with_its_bootstrap_port_and_a_policy():
    prefills = [Endpoint(21000, 21001), Endpoint(22000, 22001)]
    argv = router_argv(Endpoint(23000), 23001, prefills, Endpoint(24000), "round_robin")
    joined = " ".join(argv)
    assert "--prefill http://127.0.0.1:21000 21001 --prefill http://127.0.0.1:22000 22001 --decode" in joined
    assert argv[argv.index("--policy") + 1] == "round_robin"
    assert "--policy" not in router_argv(Endpoint(23000), 23001, prefills[:1], Endpoint(24000))


def test_only_a_prefill_that_asks_logs_its_puts():
    storage = StorageSpec("mooncake", mooncake_master="127.0.0.1:1")
    assert PrefillSpec("a", storage=storage, l3_puts_logged=True).env()["SGLANG_CP_HICACHE_L3_PUTS_LOGGED"] == "1"
    assert "SGLANG_CP_HICACHE_L3_PUTS_LOGGED" not in PrefillSpec("b", storage=storage).env()


def test_a_fleet_router_takes_its_health_checks_last():
    argv = router_argv(Endpoint(23000), 23001, [Endpoint(21000, 21001)], Endpoint(24000), "round_robin", HEALTH_ARGS)
    assert argv[-len(HEALTH_ARGS):] == list(HEALTH_ARGS)
    assert argv[argv.index("--health-check-interval-secs") + 1] == "1"
    assert "--health-check-interval-secs" not in router_argv(Endpoint(23000), 23001, [Endpoint(21000, 21001)], Endpoint(24000))


def test_prefills_of_the_faults_fleet_mount_no_segment_and_the_holder_mounts_the_store():
    segment = lambda spec: json.loads(_extra_config(LAUNCH.storage_args(spec)))["global_segment_size"]  # noqa: E731
    assert segment(StorageSpec("mooncake", mooncake_master="127.0.0.1:1", mooncake_segment_bytes=0)) == 0
    assert segment(StorageSpec("mooncake", mooncake_master="127.0.0.1:1")) == MOONCAKE_SEGMENT_BYTES
    argv = holder_argv("127.0.0.1:5", 7, PLAN.holder_bytes)
    assert Path(argv[0]).name == "mooncake_client"
    assert {"--port=7", f"--global_segment_size={PLAN.holder_bytes}", "--master_server_address=127.0.0.1:5",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"} <= set(argv)  # fmt: skip
    assert PLAN.segment_bytes == 0 and not PLAN.reader


def _extra_config(args):
    return args[args.index("--hicache-storage-backend-extra-config") + 1]


def test_the_faults_fleet_prefills_answer_health_without_a_generation():
    storage = StorageSpec("mooncake", mooncake_master="127.0.0.1:1", mooncake_segment_bytes=0)
    env = PrefillSpec("a", storage=storage, l3_puts_logged=True, extra_env=PLAN.prefill_env).env()
    assert env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] == "false" and env["SGLANG_CP_HICACHE_L3_PUTS_LOGGED"] == "1"
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION" not in PrefillSpec("b", storage=storage).env()
