"""One sharded prefill over two "nodes" on loopback (issue 45): SGLang's multi-node launch,
``--nnodes 2 --node-rank 0|1 --dist-init-addr``, as two processes on one box, each "node" on
its own loopback address (node 0 on 127.0.0.1, node 1 on 127.0.0.2: Linux routes all of
127/8 to the box), with the same ``--port`` and bootstrap port on both, as on two machines.
TP 2, one rank per node, the plugin's flag, HiCache with ``page_first`` host pools, L3 on a
Mooncake master; each node's environment names its own address (``SGLANG_HOST_IP`` for the PD
transfer endpoints, ``MOONCAKE_LOCAL_HOSTNAME`` for its ranks' store clients and segments).
PD to the session's decode through its own router; every scheduler publishes metrics
(``--enable-metrics-for-all-schedulers``).

The scenario (``two_nodes``, run by hand) checks what a two-node user depends on: what each
rank advertises to the bootstrap server (its node's address, reachable), the HTTP port the
bootstrap server pairs with node 0's host, each node's Mooncake endpoints, both nodes'
``/metrics`` (node 1 serves SGLang's stand-in health server, whose ``/metrics`` holds node 1's
processes' series only), and answers identical to the session's single-node sharded prefill,
cold and from L3 after a flush.
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import urllib.request
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Set, Tuple

from sglang_cp_hicache.testing.server.cluster import MooncakeMaster, Router, Server, log_errors
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE, Endpoint, PrefillSpec, StorageSpec
from sglang_cp_hicache.testing.server.processes import free_ports
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, flush, full_pages, tokens, wait_settled
from sglang_cp_hicache.testing.server.session import ServingSession
from sglang_cp_hicache.testing.server.store_view import StoreView, by_page

logger = logging.getLogger(__name__)

NNODES = 2
NODE_HOSTS = ("127.0.0.1", "127.0.0.2")  # node 0, node 1
NAMES = ("two-nodes-0", "two-nodes-1")
PREFIX_PAGES = 6
CONNECT_S = 3.0
MOONCAKE_LISTENS = re.compile(r"listening on (127\.\d+\.\d+\.\d+):(\d+)")


def node_of(tp_rank: int, tp: int, nnodes: int = NNODES) -> int:
    """The node of TP rank ``tp_rank`` (SGLang splits TP ranks evenly, in order, over nodes)."""
    return tp_rank // (tp // nnodes)


def node_args(node: int, dist_init_addr: str) -> Tuple[str, ...]:
    """What one node's command line adds to the single-node prefill's."""
    return ("--nnodes", str(NNODES), "--node-rank", str(node), "--dist-init-addr", dist_init_addr,
            "--enable-metrics-for-all-schedulers")  # fmt: skip


def node_env(node: int, tp: int) -> Dict[str, str]:
    """One node's own addresses (as a user sets them per machine) and its ranks' cores."""
    host, per_node, cores = NODE_HOSTS[node], tp // NNODES, os.cpu_count() or 1
    binding = "|".join(str((node * per_node + index) % cores) for index in range(tp))
    return {"SGLANG_HOST_IP": host, "MOONCAKE_LOCAL_HOSTNAME": host, "SGLANG_CPU_OMP_THREADS_BIND": binding}


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=CONNECT_S):
            return True
    except OSError:
        return False


# ------------------------------------------------------------------ what ranks advertise
@dataclass(frozen=True)
class Advertised:
    """What the prefill's bootstrap server hands a decode: the server's shape and HTTP port,
    and each CP rank's transfer endpoint (``rank_ip:rank_port``, its KV manager's socket)."""

    info: Mapping[str, object]
    ranks: Mapping[int, Tuple[str, int]]  # CP rank -> (rank_ip, rank_port)

    @classmethod
    def fetch(cls, host: str, bootstrap_port: int) -> "Advertised":
        base = f"http://{host}:{bootstrap_port}/route"
        info = _json(f"{base}?prefill_dp_rank=-1&prefill_cp_rank=-1&target_tp_rank=-1&target_pp_rank=-1")
        ranks = {}
        for cp_rank in range(int(info["attn_cp_size"])):
            row = _json(f"{base}?prefill_dp_rank=0&prefill_cp_rank={cp_rank}&target_tp_rank=0&target_pp_rank=0")
            ranks[cp_rank] = (str(row["rank_ip"]), int(row["rank_port"]))
        return cls(info, ranks)


def _json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read().decode())


def advertised_problems(advertised: Advertised, tp: int, node_ports: Sequence[int], reach=reachable) -> List[str]:
    """Each CP rank's endpoint on its own node's address and reachable; the HTTP port the
    bootstrap server advertises (a decode pairs it with node 0's host) node 0's."""
    problems = []
    if advertised.info.get("attn_cp_size") != tp:
        problems.append(f"the bootstrap server has attn_cp_size {advertised.info.get('attn_cp_size')}, want {tp}")
    for cp_rank, (ip, port) in sorted(advertised.ranks.items()):
        node = node_of(cp_rank, tp)
        if ip != NODE_HOSTS[node]:
            problems.append(f"CP rank {cp_rank} (node {node}) advertises {ip}:{port}, its node's address is {NODE_HOSTS[node]}")
        if not reach(ip, port):
            problems.append(f"CP rank {cp_rank} (node {node}): its advertised transfer endpoint {ip}:{port} is unreachable")
    http_port = advertised.info.get("prefill_http_port")
    if http_port != node_ports[0]:
        problems.append(f"the bootstrap server advertises HTTP port {http_port} (a decode pairs it with node 0's host), node 0 serves {node_ports[0]}")
    return problems


def mooncake_endpoint_problems(node_logs: Sequence[str], reach=reachable) -> Tuple[List[str], Dict[int, List[str]]]:
    """Every Mooncake endpoint each node's log says it listens on (transfer engines, store
    clients) is on that node's address and reachable; the endpoints by node."""
    problems, endpoints = [], {}
    for node, text in enumerate(node_logs):
        found = sorted(set(MOONCAKE_LISTENS.findall(text)))
        endpoints[node] = [f"{host}:{port}" for host, port in found]
        if not found:
            problems.append(f"node {node}'s log names no Mooncake endpoint")
        for host, port in found:
            if host != NODE_HOSTS[node]:
                problems.append(f"node {node}'s Mooncake endpoint {host}:{port} is not on its address {NODE_HOSTS[node]}")
            elif not reach(host, int(port)):
                problems.append(f"node {node}'s Mooncake endpoint {host}:{port} is unreachable")
    return problems, endpoints


@dataclass(frozen=True)
class NodeSeries:
    """The ranks a node's ``/metrics`` speaks for: a sample's rank is its ``attn_cp_rank``
    where it has one (the storage series: under the flag their ``tp_rank`` is the
    attention-TP rank, 0 on every CP rank), else its ``tp_rank``."""

    ranks: Set[int]
    samples: int  # SGLang's samples (``sglang:*``)
    relabelled: Set[str]  # series whose tp_rank is not their attn_cp_rank

    @classmethod
    def of(cls, metrics: Metrics) -> "NodeSeries":
        ranks, relabelled, samples = set(), set(), 0
        for name, labels, _ in metrics.samples:
            samples += name.startswith("sglang:")
            label = dict(labels)
            rank = label.get("attn_cp_rank", label.get("tp_rank"))
            if rank is not None:
                ranks.add(int(rank))
            if "attn_cp_rank" in label and label.get("tp_rank") not in (None, label["attn_cp_rank"]):
                relabelled.add(name)
        return cls(ranks, samples, relabelled)


# --------------------------------------------------------------------------- the servers
@dataclass
class TwoNodePrefill:
    session: ServingSession
    master: MooncakeMaster
    nodes: Tuple[Server, Server]
    router: Router
    store: StoreView
    start_times: Dict[str, float]

    @classmethod
    def start(cls, session: ServingSession) -> "TwoNodePrefill":
        cluster, tp = session.cluster, session.tp
        master = cluster.mooncake_master("two-nodes-mooncake-master")
        storage = StorageSpec("mooncake", mooncake_master=master.address)
        port, bootstrap, dist_port = free_ports(3)
        dist_init_addr = f"{NODE_HOSTS[0]}:{dist_port}"
        nodes = tuple(
            cluster.prefill(
                PrefillSpec(NAMES[node], tp=tp, mem_layout="page_first", storage=storage, extra_args=node_args(node, dist_init_addr)),
                Endpoint(port, bootstrap, host=NODE_HOSTS[node]),
                node_env(node, tp),
            )
            for node in range(NNODES)
        )
        router = None
        try:
            times = cluster.start(*nodes)
            router = cluster.router("router-two-nodes", nodes[0], session.decode)
            times.update(cluster.start(router))
        except BaseException:
            cluster.stop(*([router] if router else []), *nodes, master.process)
            raise
        return cls(session, master, nodes, router, StoreView(master), times)

    def retire(self) -> None:
        self.store.close()
        self.session.retire(self.router, *self.nodes, self.master.process)


# --------------------------------------------------------------------------- the scenario
def _endpoints(rec: Recorder, prefill: TwoNodePrefill) -> None:
    node0 = prefill.nodes[0].endpoint
    try:
        advertised = Advertised.fetch(node0.host, node0.bootstrap_port)
    except (OSError, ValueError, KeyError) as error:
        rec.expect(False, f"the bootstrap server at {node0.host}:{node0.bootstrap_port} did not answer: {error!r}")
        return
    for problem in advertised_problems(advertised, prefill.session.tp, [n.endpoint.port for n in prefill.nodes]):
        rec.expect(False, problem)
    ranks = ", ".join(f"CP rank {r} {ip}:{port}" for r, (ip, port) in sorted(advertised.ranks.items()))
    rec.note(f"bootstrap {node0.host}:{node0.bootstrap_port} advertises: {ranks}; HTTP port {advertised.info.get('prefill_http_port')}")
    problems, endpoints = mooncake_endpoint_problems([n.process.log_text() for n in prefill.nodes])
    for problem in problems:
        rec.expect(False, problem)
    rec.note("Mooncake endpoints by node: " + "; ".join(f"node {n} {', '.join(e)}" for n, e in endpoints.items()))


def _metrics(rec: Recorder, prefill: TwoNodePrefill) -> None:
    """Each node's ``/metrics`` holds its own ranks' series, and only those; a rank's L3
    series carry the ``tp_rank`` its other series do (here tp = cp: its ``attn_cp_rank``)."""
    tp = prefill.session.tp
    for node, server in enumerate(prefill.nodes):
        try:
            series = NodeSeries.of(server.metrics())
        except OSError as error:
            rec.expect(False, f"node {node}'s /metrics at {server.url} did not answer: {error!r}")
            continue
        want = {rank for rank in range(tp) if node_of(rank, tp) == node}
        rec.expect(series.ranks == want, f"node {node}'s /metrics speaks for ranks {sorted(series.ranks)}, want {sorted(want)}")
        rec.note(f"node {node} {server.url}/metrics: {series.samples} sglang samples, ranks {sorted(series.ranks)}")
        rec.expect(not series.relabelled, f"node {node}: tp_rank is not attn_cp_rank (tp = cp) in {sorted(series.relabelled)}")


def _placement(rec: Recorder, prefill: TwoNodePrefill, keys: Set[str]) -> None:
    """Whose segments (by node) hold the prefix's objects: reported."""
    logs = {NAMES[n]: server.process.log_text() for n, server in enumerate(prefill.nodes)}
    try:
        by_node = prefill.store.held_by(keys, logs)
    except (OSError, ValueError) as error:
        rec.note(f"placement not read: {error!r}")
        return
    rec.note(f"the prefix's objects are held in the segments of: {dict(by_node)}")


def two_nodes(session: ServingSession) -> ScenarioReport:
    """A sharded prefill over two nodes answers like the single-node sharded prefill, cold and
    from L3 (every full page a storage hit after a flush); every rank's endpoints on its own
    node's address and reachable; both nodes' ``/metrics`` scraped."""
    prefill = TwoNodePrefill.start(session)
    try:
        marks = [n.log_lines() for n in prefill.nodes]
        rec = Recorder(session, "two nodes on loopback vs the single-node sharded prefill", sharded=prefill.router, reference=session.sharded_router)
        rec.note("started: " + ", ".join(f"{name} {s:.0f} s" for name, s in prefill.start_times.items()))
        _endpoints(rec, prefill)
        prefix = tokens("two-nodes:prefix", PREFIX_PAGES * PAGE_SIZE + 10)
        before = prefill.store.keys()
        rec.pair("prefix, cold", prefix, cold=True)
        wait_settled(lambda: len(by_page(prefill.store.keys() - before)), PREFIX_PAGES)
        written = prefill.store.keys() - before
        rec.expect(len(by_page(written)) == PREFIX_PAGES, f"the store holds {len(by_page(written))} pages of the prefix, want {PREFIX_PAGES}")
        _placement(rec, prefill, written)
        for server in (prefill.nodes[0], session.sharded):
            rec.expect(flush(server), f"/flush_cache failed on {server.name}")
        a, b = rec.pair("prefix + more after the flush (L3)", prefix + tokens("two-nodes:more", 20))
        want = full_pages(len(prefix))
        if a is not None and b is not None:
            rec.expect(a.tier("storage") == want, f"two nodes' storage hit {a.cached_by_tier}, want {want}")
            rec.note(f"after the flush: two nodes hit {a.cached_by_tier}, single node {b.cached_by_tier}")
        _metrics(rec, prefill)
        rec.note(f"the prefix's {len(written)} objects: {sum(map(len, prefill.store.read(written).values()))} bytes")
        for node, server in enumerate(prefill.nodes):
            for line in log_errors(server.process, marks[node]):
                rec.expect(False, line)
        return rec.finish()
    finally:
        prefill.retire()


__all__ = ["Advertised", "NODE_HOSTS", "NodeSeries", "TwoNodePrefill", "advertised_problems", "mooncake_endpoint_problems", "node_args", "node_env", "node_of", "two_nodes"]
