"""A PD serving cluster of SGLang's own servers on loopback: prefill and decode servers
(``sglang.launch_server``), ``sglang-router`` in PD mode, a Mooncake master for the L3 store.

:class:`ServingCluster` owns every process it starts (one run folder: logs, the runtime's
``sitecustomize``, L3 folders), starts components concurrently and waits for each within a
bound, and on :meth:`ServingCluster.close` ends them all by process group and checks each
group is gone (:class:`~sglang_cp_hicache.testing.server.processes.ProcessLeak` otherwise).
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

from sglang_cp_hicache.testing.mooncake_master import holder_argv, master_argv
from sglang_cp_hicache.testing.server import launch
from sglang_cp_hicache.testing.server.jit_prebuild import NativeHashPrebuild
from sglang_cp_hicache.testing.server.launch import Endpoint, LineLaunch, PrefillSpec, ServerEnv
from sglang_cp_hicache.testing.server.metrics import Metrics
from sglang_cp_hicache.testing.server.processes import (
    ManagedProcess,
    free_ports,
    healthy,
    port_listening,
    router_ready,
)
from sglang_cp_hicache.testing.server.runtime import write_site_folder

logger = logging.getLogger(__name__)

SERVER_READY_S = 420.0  # a server start on 2 busy cores takes 20-120 s
ROUTER_READY_S = 120.0
MASTER_READY_S = 15.0
#: PD waits the servers are started with (seconds). The prefill's bootstrap wait covers a
#: request's wait for the decode's admission: the decode admits about 14 requests at once
#: (8192 tokens, 512 reserved per request), so the last prompts of a 300-prompt batch wait
#: out the batch (30 s failed it with HTTP 500 on a loaded box). A prefill frees a request
#: whose decode died before taking it only at this timeout. The decode's wait for the
#: prefill's KV starts once the prefill has taken the request.
PD_BOOTSTRAP_TIMEOUT_S = 120
PD_WAITING_TIMEOUT_S = 60
LOG_ERRORS = re.compile(r"Traceback \(most recent call last\)|\bERROR\b|KVTransferError|out of memory")
ANSI_CODES = re.compile(r"\x1b\[[0-9;]*m")  # the router colours its level names


def log_errors(process: ManagedProcess, since: int = 0) -> List[str]:
    """The error lines of ``process``'s log from line ``since`` on, named by the process."""
    lines = ANSI_CODES.sub("", process.log_text()).splitlines()[since:]
    return [f"{process.name}: {line.strip()[:240]}" for line in lines if LOG_ERRORS.search(line)]


def log_length(process: ManagedProcess) -> int:
    return len(process.log_text().splitlines())


def pd_environment() -> Dict[str, str]:
    """SGLang's Mooncake PD on loopback TCP (``testing/pd.py``'s knobs, the harness's timeouts)."""
    from sglang_cp_hicache.testing.pd import PDEnv, role_env

    return role_env(PDEnv(bootstrap_timeout_s=PD_BOOTSTRAP_TIMEOUT_S, waiting_timeout_s=PD_WAITING_TIMEOUT_S))


@dataclass
class Server:
    """An SGLang server the cluster started."""

    name: str
    endpoint: Endpoint
    process: ManagedProcess
    spec: Optional[PrefillSpec] = None  # None: the decode server

    @property
    def url(self) -> str:
        return self.endpoint.url

    def metrics(self) -> Metrics:
        return Metrics.fetch(self.url)

    def log_errors(self, since: int = 0) -> List[str]:
        return log_errors(self.process, since)

    def log_lines(self) -> int:
        return log_length(self.process)


@dataclass
class Router:
    name: str
    endpoint: Endpoint
    process: ManagedProcess
    prefill: Server
    decode: Server
    metrics_port: int
    also: Tuple[Server, ...] = ()  # its other prefill workers (a fleet router)
    policy: Optional[str] = None  # its --policy (None: the router's default)
    extra_args: Tuple[str, ...] = ()  # its last flags (a fleet router's health checks)

    @property
    def url(self) -> str:
        return self.endpoint.url

    @property
    def metrics_url(self) -> str:
        """The router's own Prometheus endpoint (its ``--prometheus-port``)."""
        return f"http://127.0.0.1:{self.metrics_port}/metrics"


@dataclass
class MooncakeMaster:
    name: str
    rpc_port: int
    metrics_port: int
    process: ManagedProcess

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def http(self) -> str:
        """The master's HTTP server (``/metrics``, ``/get_all_keys``, ``/query_key``)."""
        return f"http://127.0.0.1:{self.metrics_port}"

    def key_count(self) -> int:
        """Objects the store holds (its ``master_key_count``)."""
        return int(Metrics.fetch(self.http).total("master_key_count"))


@dataclass
class ServingCluster:
    """Every process of one serving run; :meth:`close` ends them and checks they are gone."""

    run_dir: Path
    model: Path
    line: LineLaunch = field(default_factory=launch.line_launch)
    processes: Dict[str, ManagedProcess] = field(default_factory=dict)
    start_times: Dict[str, float] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.env = ServerEnv(
            write_site_folder(self.run_dir / "site"), self.run_dir / "tmp", pd_environment()
        )
        self.prebuild: Optional[NativeHashPrebuild] = (
            NativeHashPrebuild(self.env.plain(), self.run_dir / "logs" / "prebuild.log")
            if self.line.lazy_page_hash_extension
            else None
        )

    def serving(self, model: Path) -> "ServingCluster":
        """This cluster's servers of another checkpoint: the same run folder, environment and
        native build; the processes it starts are this cluster's too (:meth:`close` of
        either ends them)."""
        twin = copy.copy(self)
        twin.model = model
        return twin

    # ------------------------------------------------------------------ components
    def _managed(
        self, name: str, argv: List[str], env: Dict[str, str], ready, ready_within_s: float
    ) -> ManagedProcess:
        if name in self.processes and self.processes[name].running():
            raise RuntimeError(f"{name} is already running")
        log = self.run_dir / "logs" / f"{name}.log"
        process = ManagedProcess(name, argv, env, log, ready, ready_within_s)
        self.processes[name] = process
        return process

    def prefill(self, spec: PrefillSpec, endpoint: Optional[Endpoint] = None, env: Optional[Dict[str, str]] = None) -> Server:
        """A prefill server of ``spec`` on ``endpoint`` (None: free loopback ports), its
        environment with ``env`` over the spec's (one "node"'s addresses: ``two_nodes.py``)."""
        if endpoint is None:
            port, bootstrap, events = free_ports(3)
            endpoint = Endpoint(port, bootstrap, events if spec.kv_events else 0)
        argv = launch.prefill_argv(self.line, self.model, endpoint, spec)
        environment = self.env.for_tp(spec.tp, {**spec.env(), **(env or {})})
        process = self._managed(spec.name, argv, environment, healthy(endpoint.url), SERVER_READY_S)
        return Server(spec.name, endpoint, process, spec)

    def decode(self, name: str = "decode", extra_args: Sequence[str] = ()) -> Server:
        endpoint = Endpoint(free_ports(1)[0])
        argv = launch.decode_argv(self.line, self.model, endpoint, extra_args)
        env = self.env.for_tp(1)
        return Server(name, endpoint, self._managed(name, argv, env, healthy(endpoint.url), SERVER_READY_S))

    def router(
        self,
        name: str,
        prefill: Server,
        decode: Server,
        also: Sequence[Server] = (),
        policy: Optional[str] = None,
        extra_args: Sequence[str] = (),
    ) -> Router:
        """A PD router over ``prefill`` (and the prefills ``also``) and ``decode``."""
        port, prometheus = free_ports(2)
        endpoint = Endpoint(port)
        prefills = [prefill.endpoint, *(server.endpoint for server in also)]
        argv = launch.router_argv(endpoint, prometheus, prefills, decode.endpoint, policy, extra_args)
        ready = router_ready(endpoint.url, len(prefills) + 1)
        process = self._managed(name, argv, self.env.plain(), ready, ROUTER_READY_S)
        return Router(name, endpoint, process, prefill, decode, prometheus, tuple(also), policy, tuple(extra_args))

    def mooncake_master(self, name: str = "mooncake-master") -> "MooncakeMaster":
        """Start a Mooncake master on loopback (a ``mooncake`` L3 tier's store)."""
        rpc, metrics_port = free_ports(2)
        argv = master_argv(rpc, metrics_port)
        process = self._managed(name, argv, self.env.plain(), port_listening(rpc), MASTER_READY_S)
        self.start(process)
        return MooncakeMaster(name, rpc, metrics_port, process)

    def mooncake_holder(self, name: str, master: "MooncakeMaster", segment_bytes: int) -> ManagedProcess:
        """Start a segment holder on ``master`` (``mooncake_client`` mounting
        ``segment_bytes``): where the objects of prefills that mount no segment live."""
        port = free_ports(1)[0]
        argv = holder_argv(master.address, port, segment_bytes)
        process = self._managed(name, argv, self.env.plain(), port_listening(port), MASTER_READY_S)
        self.start(process)
        return process

    # ------------------------------------------------------------------- lifecycle
    def start(self, *components) -> Dict[str, float]:
        """Start ``components`` together, then wait for each; their start times (s)."""
        processes = [getattr(c, "process", c) for c in components]
        if self.prebuild is not None:
            self.prebuild.start()  # once, beside the first servers' start
        for process in processes:
            process.start()
        if self.prebuild is not None:
            self.prebuild.wait()  # before any request (upstream builds it at the first storage query)
        for process in processes:
            self.start_times[process.name] = process.wait_ready()
        return {p.name: self.start_times[p.name] for p in processes}

    def stop(self, *components) -> None:
        for component in components:
            getattr(component, "process", component).stop()

    def close(self) -> None:
        """End every process this cluster started, newest first; raise naming any leak."""
        leaks = []
        if self.prebuild is not None:
            self.prebuild.stop()
        for process in reversed(list(self.processes.values())):
            try:
                process.stop()
            except Exception as error:  # keep ending the others
                leaks.append(str(error))
        if leaks:
            raise RuntimeError("; ".join(leaks))

    def running(self) -> List[str]:
        return [name for name, process in self.processes.items() if process.running()]

    def log_marks(self) -> Dict[str, Tuple[ManagedProcess, int]]:
        """Where every process's log ends now (for :meth:`errors_since`)."""
        return {name: (process, log_length(process)) for name, process in self.processes.items()}

    def errors_since(self, marks: Dict[str, Tuple[ManagedProcess, int]]) -> List[str]:
        """The error lines every process logged after ``marks`` (routers and decode included;
        a process started since, e.g. a restarted decode, from its first line)."""
        errors: List[str] = []
        for name, process in self.processes.items():
            marked, since = marks.get(name, (None, 0))
            errors += log_errors(process, since if marked is process else 0)
        return errors

    def __enter__(self) -> "ServingCluster":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["MooncakeMaster", "PD_BOOTSTRAP_TIMEOUT_S", "PD_WAITING_TIMEOUT_S", "Router", "Server", "ServingCluster", "log_errors", "pd_environment"]
