"""The two-node scenario's checks (``testing/server/two_nodes.py``) without servers: what each
rank advertises to the bootstrap server (its node's address, reachable: real sockets on
127.0.0.1 and 127.0.0.2), each node's Mooncake endpoints from its log, the ranks a node's
``/metrics`` speaks for, and the two nodes' command lines and environments."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from sglang_cp_hicache.testing.server.launch import Endpoint, PrefillSpec, line_launch, prefill_argv
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.two_nodes import (
    NODE_HOSTS,
    Advertised,
    NodeSeries,
    advertised_problems,
    mooncake_endpoint_problems,
    node_args,
    node_env,
    node_of,
)

HTTP_PORT = 30000


@pytest.fixture
def listening():
    """A listening socket on each node's loopback address: {node: port}."""
    sockets = []
    try:
        for host in NODE_HOSTS:
            sock = socket.socket()
            sock.bind((host, 0))
            sock.listen()
            sockets.append(sock)
        yield {node: sock.getsockname()[1] for node, sock in enumerate(sockets)}
    finally:
        for sock in sockets:
            sock.close()


def _advertised(ranks, http_port=HTTP_PORT, cp=2) -> Advertised:
    return Advertised({"attn_cp_size": cp, "prefill_http_port": http_port}, ranks)


def test_tp_ranks_split_evenly_over_the_nodes_in_order():
    assert [node_of(rank, 2) for rank in range(2)] == [0, 1]
    assert [node_of(rank, 8) for rank in range(8)] == [0] * 4 + [1] * 4


def test_each_node_names_its_own_address_for_pd_and_the_store():
    for node, host in enumerate(NODE_HOSTS):
        env = node_env(node, 2)
        assert env["SGLANG_HOST_IP"] == env["MOONCAKE_LOCAL_HOSTNAME"] == host
    assert NODE_HOSTS[0] != NODE_HOSTS[1]


def test_both_nodes_launch_the_same_prefill_with_their_node_rank_and_node_0s_dist_init_addr():
    line = line_launch()
    argvs = [
        prefill_argv(line, Path("m"), Endpoint(HTTP_PORT, 30001, host=NODE_HOSTS[node]), PrefillSpec(f"n{node}", extra_args=node_args(node, "127.0.0.1:5000")))
        for node in range(2)
    ]
    for node, argv in enumerate(argvs):
        flags = dict(zip(argv, argv[1:]))
        assert (flags["--nnodes"], flags["--node-rank"], flags["--dist-init-addr"]) == ("2", str(node), "127.0.0.1:5000")
        assert (flags["--host"], flags["--port"], flags["--disaggregation-bootstrap-port"]) == (NODE_HOSTS[node], str(HTTP_PORT), "30001")
        assert "--enable-nsa-prefill-cp-shared-kv" in argv and "--enable-metrics-for-all-schedulers" in argv
    assert [a for a in argvs[0] if a not in (NODE_HOSTS[0], "0")] == [a for a in argvs[1] if a not in (NODE_HOSTS[1], "1")]


def test_ranks_on_their_nodes_addresses_and_reachable_pass(listening):
    advertised = _advertised({rank: (NODE_HOSTS[rank], listening[rank]) for rank in range(2)})
    assert advertised_problems(advertised, 2, [HTTP_PORT, HTTP_PORT]) == []


def test_node_1_advertising_node_0s_host_is_named(listening):
    advertised = _advertised({0: (NODE_HOSTS[0], listening[0]), 1: (NODE_HOSTS[0], listening[0])})
    problems = advertised_problems(advertised, 2, [HTTP_PORT, HTTP_PORT])
    assert problems == [f"CP rank 1 (node 1) advertises {NODE_HOSTS[0]}:{listening[0]}, its node's address is {NODE_HOSTS[1]}"]


def test_an_unreachable_endpoint_and_another_nodes_http_port_are_named(listening):
    with socket.socket() as closed:
        closed.bind((NODE_HOSTS[1], 0))
        dead = closed.getsockname()[1]  # bound, never listening
        advertised = _advertised({0: (NODE_HOSTS[0], listening[0]), 1: (NODE_HOSTS[1], dead)}, http_port=31000)
        problems = advertised_problems(advertised, 2, [HTTP_PORT, 31000])
    assert problems == [
        f"CP rank 1 (node 1): its advertised transfer endpoint {NODE_HOSTS[1]}:{dead} is unreachable",
        f"the bootstrap server advertises HTTP port 31000 (a decode pairs it with node 0's host), node 0 serves {HTTP_PORT}",
    ]


def test_a_missing_cp_rank_is_named():
    problems = advertised_problems(_advertised({}, cp=1), 2, [HTTP_PORT, HTTP_PORT])
    assert problems == ["the bootstrap server has attn_cp_size 1, want 2"]


def test_mooncake_endpoints_are_read_per_node_and_checked(listening):
    logs = [
        f"I1207 transfer_engine_impl.cpp:183] Transfer Engine RPC using P2P handshake, listening on {NODE_HOSTS[0]}:{listening[0]}\n",
        f"... listening on {NODE_HOSTS[1]}:{listening[1]}\n... listening on {NODE_HOSTS[0]}:{listening[0]}\n",
    ]
    problems, endpoints = mooncake_endpoint_problems(logs)
    assert endpoints == {0: [f"{NODE_HOSTS[0]}:{listening[0]}"], 1: sorted([f"{NODE_HOSTS[0]}:{listening[0]}", f"{NODE_HOSTS[1]}:{listening[1]}"])}
    assert problems == [f"node 1's Mooncake endpoint {NODE_HOSTS[0]}:{listening[0]} is not on its address {NODE_HOSTS[1]}"]
    assert mooncake_endpoint_problems(["", logs[0]])[0] == ["node 0's log names no Mooncake endpoint", f"node 1's Mooncake endpoint {NODE_HOSTS[0]}:{listening[0]} is not on its address {NODE_HOSTS[1]}"]


def test_a_nodes_series_speak_for_their_cp_rank_the_storage_series_by_attn_cp_rank():
    node_1 = Metrics.parse(
        'sglang:num_running_reqs{engine_type="prefill",tp_rank="1",pp_rank="0"} 0.0\n'
        'sglang:backuped_tokens_total{storage_backend="mooncake",tp_rank="0",attn_cp_rank="1",attn_cp_size="2"} 192.0\n'
        "process_cpu_seconds_total 3.0\n"
    )
    series = NodeSeries.of(node_1)
    assert (series.ranks, series.samples, series.relabelled) == ({1}, 2, {"sglang:backuped_tokens_total"})
    stray = Metrics.parse('sglang:num_running_reqs{tp_rank="0"} 0.0\n')
    assert NodeSeries.of(stray).ranks == {0}
