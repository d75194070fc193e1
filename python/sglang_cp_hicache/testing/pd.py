"""Multi-process PD disaggregation on loopback: process lifecycle, bootstrap server, engine env.

Line-agnostic pieces of the PD harness (each line's rank bodies live in
``testing/<line>/pd_harness.py``):

* :class:`PDCluster` starts named role processes from the CPU runtime's forkserver (SGLang is
  already imported there), each with its own environment, talks to them over a pipe, bounds
  every wait, and kills whatever is still running when it closes;
* :func:`role_env` is what each process needs for SGLang's Mooncake backend on loopback TCP:
  the engine pinned to 127.0.0.1 and to TCP, the CP-ranks-transfer switch, PD timeouts;
* :func:`serve_bootstrap` is the bootstrap server's role (upstream's
  ``MooncakeKVBootstrapServer``, as the prefill server's main process runs it);
* :func:`run_pd_cluster`, :func:`run_fault_cluster` and :func:`prefill_startup_failure`
  run a line's roles, given as its :class:`PDLine` adapter (``<line>.pd_harness.LINE``).

SGLang's PD threads (prefill bootstrap, decode, heartbeat) are non-daemon and block on ZMQ
forever, so a role never returns through the interpreter's shutdown: its process reports
and ends with ``os._exit``. A watchdog ends it after its lifetime even if no one kills it.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple, Union

import requests

from sglang_cp_hicache.testing.dist import _free_port, _function_ref, _get_context, _resolve_function

LOOPBACK = "127.0.0.1"
ALL_CP_RANKS_TRANSFER_ENV = "SGLANG_DISAGGREGATION_ALL_CP_RANKS_TRANSFER"
_WATCHDOG_EXIT_CODE = 124
_WATCHDOG_POLL_S = 1.0  # how often a role checks that its harness is still there


class RoleFailed(RuntimeError):
    """A role raised, died, or did not answer in time; the message names the role."""


class BootstrapUnreachable(RuntimeError):
    """The PD bootstrap server did not answer its health check in time."""


@dataclass(frozen=True)
class PDEnv:
    """The environment of one PD process (every value is SGLang's or Mooncake's own knob)."""

    all_cp_ranks_transfer: bool = True
    bootstrap_timeout_s: int = 60  # prefill: a request waiting for decode's metadata
    waiting_timeout_s: int = 60  # decode: a request waiting for prefill's last chunk
    heartbeat_interval_s: float = 2.0  # decode -> bootstrap health checks (SGLang's minimum)


def role_env(env: PDEnv) -> Dict[str, str]:
    """Environment variables of a PD process on loopback TCP."""
    return {
        "SGLANG_HOST_IP": LOOPBACK,  # the KV managers' ZMQ endpoints and the engine's hostname
        "MC_FORCE_TCP": "1",  # SGLang asks for "rdma"; without an HCA force TCP, deterministic
        ALL_CP_RANKS_TRANSFER_ENV: "1" if env.all_cp_ranks_transfer else "0",
        "SGLANG_DISAGGREGATION_BOOTSTRAP_TIMEOUT": str(env.bootstrap_timeout_s),
        "SGLANG_DISAGGREGATION_WAITING_TIMEOUT": str(env.waiting_timeout_s),
        "SGLANG_DISAGGREGATION_HEARTBEAT_INTERVAL": str(env.heartbeat_interval_s),
        # Two missed health checks (SGLang's default) declare the prefill dead; a loaded
        # 2-core box can stall the bootstrap process that long.
        "SGLANG_DISAGGREGATION_HEARTBEAT_MAX_FAILURE": "5",
        # One transfer queue and two sender threads per rank: the machine has 2 cores.
        "SGLANG_DISAGGREGATION_QUEUE_SIZE": "1",
        "SGLANG_DISAGGREGATION_THREAD_POOL_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }


@dataclass(frozen=True)
class PDPorts:
    """Loopback ports of one cluster: the bootstrap server's and the prefill gloo world's."""

    bootstrap: int
    gloo: int

    @classmethod
    def pick(cls) -> "PDPorts":
        return cls(bootstrap=_free_port(), gloo=_free_port())


def free_port() -> int:
    """A loopback port nobody listens on right now (e.g. an unreachable bootstrap)."""
    return _free_port()


# ------------------------------------------------------------------ the child side
class RoleChannel:
    """A role's end of its pipe: events and checkpoints to the harness, its replies back."""

    def __init__(self, conn: multiprocessing.connection.Connection, name: str):
        self._conn = conn
        self.name = name

    def event(self, name: str, payload: Any = None) -> None:
        """Tell the harness something happened; do not wait."""
        self._conn.send(("event", name, payload))

    def checkpoint(self, name: str, payload: Any = None, timeout_s: float = 60.0) -> Any:
        """Report ``name`` and block until the harness answers it (its reply's payload)."""
        self.event(name, payload)
        return self.wait(name, timeout_s)

    def wait(self, name: str, timeout_s: float) -> Any:
        """Block until the harness sends ``name``; raise after ``timeout_s``."""
        if not self._conn.poll(timeout_s):
            raise TimeoutError(f"{self.name}: no {name!r} from the harness within {timeout_s:.0f} s")
        kind, got, payload = self._conn.recv()
        if (kind, got) != ("reply", name):
            raise RuntimeError(f"{self.name}: expected reply {name!r}, got {kind} {got!r}")
        return payload


def _gone(pid: int) -> bool:
    """``pid`` has exited (reaped, or a zombie nobody reaped yet)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _watchdog(lifetime_s: float, name: str, harness_pid: int) -> None:
    """End the role after ``lifetime_s``, or as soon as the harness process that started
    it is gone (the forkserver, the role's parent, can outlive a killed harness)."""
    end = time.monotonic() + lifetime_s
    reason = f"lifetime of {lifetime_s:.0f} s over"
    while time.monotonic() < end:
        time.sleep(min(_WATCHDOG_POLL_S, max(0.0, end - time.monotonic())))
        if _gone(harness_pid):
            reason = "harness gone"
            break
    sys.stderr.write(f"pd role {name}: {reason}, exiting\n")
    sys.stderr.flush()
    os._exit(_WATCHDOG_EXIT_CODE)


def _role_child(
    name: str, fn_ref, env: Dict[str, str], lifetime_s: float, harness_pid: int, args, conn
) -> None:
    """Entry point of a role process: env, CPU runtime, the role, one report, ``os._exit``."""
    os.environ.update(env)
    threading.Thread(target=_watchdog, args=(lifetime_s, name, harness_pid), daemon=True).start()
    try:
        from sglang_cp_hicache.testing import install

        install()
        fn = _resolve_function(fn_ref)
        result = fn(RoleChannel(conn, name), *args)
        conn.send(("result", None, result))
    except BaseException:  # report every failure, assertion errors included
        conn.send(("error", None, traceback.format_exc()))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)  # SGLang's non-daemon PD threads would block a normal exit


# ------------------------------------------------------------------ the harness side
@dataclass
class RoleProcess:
    """One role's process and the harness's end of its pipe."""

    name: str
    process: Any
    conn: multiprocessing.connection.Connection
    events: List[Tuple[str, Any]] = field(default_factory=list)
    result: Any = None
    done: bool = False

    def _receive(self, timeout_s: float) -> Tuple[str, Optional[str], Any]:
        deadline = time.monotonic() + timeout_s
        while True:
            if self.conn.poll(min(0.2, max(0.0, deadline - time.monotonic()))):
                try:
                    return self.conn.recv()
                except EOFError:  # a role reports before it exits: it died without a report
                    self.process.join(timeout=5)
                    raise RoleFailed(f"{self.name}: exited with code {self.process.exitcode} without reporting")
            if time.monotonic() >= deadline:
                raise RoleFailed(f"{self.name}: no report within {timeout_s:.0f} s")

    def next_message(self, timeout_s: float) -> Tuple[str, Optional[str], Any]:
        """The role's next message; a role's error is raised here with its traceback."""
        kind, name, payload = self._receive(timeout_s)
        if kind == "error":
            self.done = True
            raise RoleFailed(f"{self.name} raised:\n{payload}")
        if kind == "result":
            self.done, self.result = True, payload
        else:
            self.events.append((name, payload))
        return kind, name, payload

    def wait_event(self, name: str, timeout_s: float) -> Any:
        """Block until the role reports event ``name`` (earlier events are kept)."""
        deadline = time.monotonic() + timeout_s
        for got, payload in self.events:
            if got == name:
                return payload
        while True:
            kind, got, payload = self.next_message(max(0.0, deadline - time.monotonic()))
            if kind == "result":
                raise RoleFailed(f"{self.name}: finished without event {name!r}")
            if got == name:
                return payload

    def reply(self, name: str, payload: Any = None) -> None:
        self.conn.send(("reply", name, payload))

    def wait_result(self, timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while not self.done:
            self.next_message(max(0.0, deadline - time.monotonic()))
        return self.result

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=10)


class PDCluster:
    """Named role processes of one PD run; every process it started is ended by :meth:`close`.

    Use as a context manager. Every wait is bounded; a role that raises, dies or stays
    silent fails the run with a :class:`RoleFailed` naming it.
    """

    def __init__(self, lifetime_s: float = 240.0):
        self.lifetime_s = lifetime_s
        self.ports = PDPorts.pick()
        self.roles: Dict[str, RoleProcess] = {}

    def __enter__(self) -> "PDCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def start(self, name: str, fn: Callable[..., Any], *args: Any, env: PDEnv = PDEnv()) -> RoleProcess:
        """Start role ``name`` running ``fn(channel, *args)`` (``fn`` module-level, its
        arguments and result picklable)."""
        if name in self.roles and self.roles[name].process.is_alive():
            raise ValueError(f"role {name!r} is already running")
        ctx = _get_context()
        parent, child = ctx.Pipe()
        process = ctx.Process(
            target=_role_child,
            args=(name, _function_ref(fn), role_env(env), self.lifetime_s, os.getpid(), args, child),
            name=f"pd-{name}",
        )
        process.start()
        child.close()
        role = RoleProcess(name, process, parent)
        self.roles[name] = role
        return role

    def start_bootstrap(self, timeout_s: float = 30.0) -> RoleProcess:
        """The bootstrap server's process; returns once it answers its health check."""
        role = self.start("bootstrap", serve_bootstrap, LOOPBACK, self.ports.bootstrap, self.lifetime_s)
        role.wait_event("serving", timeout_s)
        wait_until_serving(LOOPBACK, self.ports.bootstrap, timeout_s)
        return role

    def results(self, names: List[str], timeout_s: float) -> Dict[str, Any]:
        """Every named role's result, waiting at most ``timeout_s`` in all; the first role
        that fails (or the deadline) raises at once, naming it."""
        deadline = time.monotonic() + timeout_s
        pending = [self.roles[n] for n in names]
        while pending:
            for role in list(pending):
                if role.done:
                    pending.remove(role)
                elif role.conn.poll(0) or not role.process.is_alive():
                    role.next_message(timeout_s=1.0)
            if pending and time.monotonic() > deadline:
                raise RoleFailed(f"no result from {[r.name for r in pending]} within {timeout_s:.0f} s")
            if pending:
                multiprocessing.connection.wait([r.conn for r in pending], timeout=0.2)
        return {n: self.roles[n].result for n in names}

    def kill(self, name: str) -> None:
        self.roles[name].kill()

    def close(self) -> None:
        """Stop the bootstrap server, then kill every role still running."""
        bootstrap = self.roles.get("bootstrap")
        if bootstrap is not None and bootstrap.process.is_alive():
            try:
                bootstrap.reply("stop")
                bootstrap.process.join(timeout=5)
            except (BrokenPipeError, OSError):
                pass
        for role in self.roles.values():
            role.kill()
            role.conn.close()


#: A prefill role's event once its KV manager registered with the bootstrap server. A
#: decode asks the bootstrap server for the prefill's ranks at its first request and gives
#: up after a few tries, so a cluster starts its decode once every prefill rank registered.
REGISTERED = "registered"
#: What a prefill role holding after :data:`REGISTERED` (``hold_after_registering``) waits for.
GO = "go"
#: How long a holding prefill role waits for :data:`GO`: a loaded box can take that long to
#: start the decodes the harness waits for first (their lifetime ends the role anyway).
_GO_WAIT_S = 180.0


def hold_if_asked(channel: RoleChannel, scenario: Any) -> None:
    """A prefill role, right after :data:`REGISTERED`: with ``scenario.hold_after_registering``
    wait for the harness's :data:`GO` before the first request."""
    if scenario.hold_after_registering:
        channel.wait(GO, timeout_s=_GO_WAIT_S)


#: How long the bootstrap server may take, once every prefill rank reported
#: :data:`REGISTERED`, to list the prefill as registered (each rank's PUT already returned).
REGISTRATION_VISIBLE_S = 10.0


def wait_registered(cluster: "PDCluster", names: List[str], timeout_s: float) -> None:
    """Block until every named prefill role reported :data:`REGISTERED` and the cluster's
    bootstrap server lists the prefill as registered; a prefill that reports but never
    registered fails here, naming the bootstrap server, not as a decode's long wait."""
    for name in names:
        cluster.roles[name].wait_event(REGISTERED, timeout_s)
    wait_prefill_registered(LOOPBACK, cluster.ports.bootstrap, REGISTRATION_VISIBLE_S)


@dataclass(frozen=True)
class PDLine:
    """One SGLang line's PD roles, the adapter the line-agnostic cluster runners take:
    ``prefill_role(channel, rank, scenario, ports)`` serves ``scenario`` as CP rank
    ``rank`` (reporting :data:`REGISTERED` once its KV manager registered) and returns its
    outcomes; ``decode_role(channel, scenario, ports, rids=None)`` serves the scenario's
    requests (or only ``rids``) and returns its report. Both module-level (they run in
    role processes)."""

    prefill_role: Callable[..., Any]
    decode_role: Callable[..., Any]


def prefill_names(cp_size: int) -> List[str]:
    """The prefill roles' names in a cluster of ``cp_size`` ranks."""
    return [f"prefill{r}" for r in range(cp_size)]


def run_pd_cluster(
    line: PDLine,
    scenario: Any,
    timeout_s: float = 150.0,
    prefill_env: PDEnv = PDEnv(),
    decode_env: PDEnv = PDEnv(),
) -> Dict[str, Any]:
    """Run ``scenario`` on one cluster of ``line``'s roles (bootstrap, ``cp_size`` prefill
    ranks, one decode), every process ended on return. Returns each role's result by name
    (``prefill<r>``: the rank's outcomes; ``decode``: the decode's report), ``all_ended``
    and ``wall_s``."""
    start = time.monotonic()
    names = prefill_names(scenario.cp_size)
    with PDCluster() as cluster:
        cluster.start_bootstrap()
        for rank, name in enumerate(names):
            cluster.start(name, line.prefill_role, rank, scenario, cluster.ports, env=prefill_env)
        wait_registered(cluster, names, timeout_s)
        cluster.start("decode", line.decode_role, scenario, cluster.ports, env=decode_env)
        results = cluster.results(names + ["decode"], timeout_s)
    results["all_ended"] = all(r.process.exitcode is not None for r in cluster.roles.values())
    results["wall_s"] = time.monotonic() - start
    return results


def _with_registration_wait(channel: RoleChannel, wait_s: float, role_ref: Tuple[str, str, str], *args: Any) -> Any:
    """Role: ``role_ref``'s role with the plugin's bootstrap registration bound set to ``wait_s``."""
    from sglang_cp_hicache.core import bootstrap_probe

    bootstrap_probe.REGISTRATION_WAIT_S = wait_s  # read at each registration
    return _resolve_function(role_ref)(channel, *args)


def prefill_startup_failure(line: PDLine, scenario: Any, timeout_s: float, registration_wait_s: float) -> str:
    """Start ``scenario.cp_size`` ranks of ``line``'s prefill role against a bootstrap
    address nobody serves (the cluster starts no bootstrap server), each rank waiting
    ``registration_wait_s`` for it (the plugin's bound, 10 s when served; a test needs no
    more than a few), and return the first rank's failure (its traceback); raise
    AssertionError if every rank started and served."""
    names = prefill_names(scenario.cp_size)
    role_ref = _function_ref(line.prefill_role)
    with PDCluster() as cluster:
        for rank, name in enumerate(names):
            cluster.start(
                name, _with_registration_wait, registration_wait_s, role_ref, rank, scenario, cluster.ports
            )
        try:
            cluster.results(names, timeout_s)
        except RoleFailed as failed:
            return str(failed)
    raise AssertionError(f"the prefill ranks started with bootstrap port {cluster.ports.bootstrap} unserved")


def run_fault_cluster(
    line: PDLine,
    scenario: Any,
    rids: Tuple[str, str, str],
    prefill_env: PDEnv,
    no_env_decode: PDEnv,
    timeout_s: float,
) -> Dict[str, Any]:
    """The fault cluster of ``line``'s roles, at ``scenario.cp_size``: ``rids`` = (killed,
    no-env, next). decode-a serves the killed request and dies once its first chunk went
    out (the prefill ranks wait at their ``chunk-sent`` checkpoint meanwhile); decode-b,
    started with ``no_env_decode``, serves no-env; decode-c serves next. The prefill ranks
    hold after registering until decode-a and decode-c are up, so ``prefill_env``'s
    bootstrap timeout bounds the metadata's way only, not a decode's start. Every role's
    result by name (not decode-a's), and ``all_ended``."""
    killed, no_env, following = rids
    prefills = prefill_names(scenario.cp_size)
    scenario = dataclasses.replace(scenario, hold_after_registering=True)
    with PDCluster() as cluster:
        cluster.start_bootstrap()
        for rank, name in enumerate(prefills):
            cluster.start(name, line.prefill_role, rank, scenario, cluster.ports, env=prefill_env)
        wait_registered(cluster, prefills, timeout_s)
        for name, rid in (("decode-a", killed), ("decode-c", following)):
            cluster.start(name, line.decode_role, scenario, cluster.ports, [rid])
        for name in ("decode-a", "decode-c"):
            cluster.roles[name].wait_event("ready", timeout_s)
        for name in prefills:
            cluster.roles[name].reply(GO)
        for name in prefills:
            cluster.roles[name].wait_event("chunk-sent", timeout_s)
        cluster.kill("decode-a")
        decode_b = cluster.start("decode-b", line.decode_role, scenario, cluster.ports, [no_env], env=no_env_decode)
        decode_b.wait_event("ready", timeout_s)
        for name in prefills:
            cluster.roles[name].reply("chunk-sent")
        results = cluster.results(prefills + ["decode-b", "decode-c"], timeout_s)
    results["all_ended"] = all(r.process.exitcode is not None for r in cluster.roles.values())
    return results


# ------------------------------------------------------------------ bootstrap server
def wait_until_serving(host: str, port: int, timeout_s: float) -> None:
    """Poll the bootstrap server's ``/health`` until it answers 200; raise
    :class:`BootstrapUnreachable` naming the address otherwise."""
    url = f"http://{host}:{port}/health"
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        try:
            response = requests.get(url, timeout=1.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}"
        except requests.RequestException as error:
            last = error
        time.sleep(0.05)
    raise BootstrapUnreachable(f"PD bootstrap server {url} did not answer within {timeout_s:.0f} s: {last}")


def wait_prefill_registered(host: str, port: int, timeout_s: float) -> None:
    """Poll the bootstrap server until it serves the prefill's parallel info (what a
    decode asks first: ``GET /route`` with every rank -1 answers 200 only once every
    prefill rank registered); raise :class:`RoleFailed` naming the address otherwise."""
    url = f"http://{host}:{port}/route"
    query = {"prefill_dp_rank": -1, "prefill_cp_rank": -1, "target_tp_rank": -1, "target_pp_rank": -1}
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while True:
        try:
            response = requests.get(url, params=query, timeout=1.0)
            if response.status_code == 200:
                return
            last = f"HTTP {response.status_code}: {response.text}"
        except requests.RequestException as error:
            last = error
        if time.monotonic() >= deadline:
            break
        time.sleep(0.05)
    raise RoleFailed(
        f"the prefill is not registered with bootstrap server {host}:{port} within "
        f"{timeout_s:.0f} s of its ranks reporting {REGISTERED!r}: {last}"
    )


def serve_bootstrap(channel: RoleChannel, host: str, port: int, lifetime_s: float) -> None:
    """Role: upstream's Mooncake bootstrap server on ``host:port`` until told to stop."""
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVBootstrapServer

    MooncakeKVBootstrapServer(host, port)  # serves from its own (daemon) thread
    wait_until_serving(host, port, timeout_s=30.0)
    channel.event("serving")
    channel.wait("stop", timeout_s=lifetime_s)


# ------------------------------------------------------------------ scenario steps and outcomes
SENTINEL_BYTE = 0xA5  # a decode pool's bytes before any transfer


@dataclass(frozen=True)
class PDRequest:
    """One request, served by every prefill rank and the decode server in scenario order.

    ``chunk_tokens`` splits the prefill into forwards the way SGLang's chunked prefill
    does (the first chunk ends on a page boundary). ``bootstrap_port`` (decode only)
    overrides the cluster's: a port nobody serves makes the bootstrap unreachable.
    """

    rid: str
    token_ids: Tuple[int, ...]
    room: int
    chunk_tokens: Optional[int] = None
    bootstrap_port: Optional[int] = None

    @property
    def next_token(self) -> int:
        """The first output token the prefill hands to decode as aux data."""
        return (sum(self.token_ids) + len(self.token_ids)) % 50000 + 1


@dataclass(frozen=True)
class EvictDevice:
    """Prefill step: back everything up, evict it from device and wipe the device bytes, so
    a later hit on it can only come back through a real host load-back."""


Step = Union[PDRequest, EvictDevice]

#: The negative controls both lines' harnesses plant in the prefill side's owner filter
#: (what each breaks: the line's ``PDScenario``).
PLANTS = ("wrong_owner", "rank_skips_send")


class ScenarioSteps:
    """What both lines' ``PDScenario`` (frozen dataclasses with ``steps`` and ``plants``,
    request id -> one of :data:`PLANTS`) read of their steps."""

    steps: Tuple[Step, ...]
    plants: Tuple[Tuple[str, str], ...]

    def check_plants(self) -> None:
        for rid, plant in self.plants:
            if plant not in PLANTS:
                raise ValueError(f"plant {plant!r} for {rid}: choose from {PLANTS}")

    @property
    def requests(self) -> List[PDRequest]:
        return [s for s in self.steps if isinstance(s, PDRequest)]

    def plant_for(self, rid: str) -> Optional[str]:
        """The bug planted while request ``rid`` is served (None: none)."""
        return dict(self.plants).get(rid)


@dataclass
class PrefillOutcome:
    """One prefill rank's view of one request.

    ``payload_bytes``: KV and state bytes this rank handed to its transfer engine (aux
    excluded); ``owned_pages``: pages of the request this rank owns.
    """

    rid: str
    rank: int
    success: bool
    failure: str = ""
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    chunks: int = 0
    transfer_s: float = 0.0  # last chunk sent -> CP-wide Success (or Failed) polled
    engine_s: float = 0.0  # time inside the transfer engine's batch writes, all chunks
    failure_detected_s: float = 0.0  # from the checkpoint's release to the Failed poll
    payload_bytes: int = 0
    owned_pages: int = 0
    pools_unchanged: bool = True
    leaked: List[str] = field(default_factory=list)


@dataclass
class DecodeOutcome:
    """The decode server's view of one request, checked on its own pool."""

    rid: str
    success: bool
    failure: str = ""
    kv_mismatches: int = 0  # tokens whose target KV or indexer bytes differ from the reference
    draft_mismatches: int = 0  # tokens whose draft KV or indexer bytes differ
    aux_ok: bool = False  # first output token (and, with MTP, hidden state) as prefill set them
    granted_pages: int = 0
    granted_pages_touched: int = 0  # of a failed request: granted pages whose bytes changed
    transfer_s: float = 0.0
    errors_logged: List[str] = field(default_factory=list)


@dataclass
class DecodeReport:
    """The decode role's result: per request, then the end-of-run checks over the pool."""

    outcomes: List[DecodeOutcome]
    final_kv_mismatches: int  # every successful request re-checked after all transfers
    final_draft_mismatches: int
    off_grant_pages_changed: int  # pages never granted to a request whose bytes changed
    final_planted_kv_mismatches: int  # the planted (negative-control) requests, re-checked apart


# ------------------------------------------------------------------ the roles' shared steps
_POLL_S = 0.01


def load_plugins() -> None:
    """The plugin loaded as SGLang loads it (the installed line's hooks applied)."""
    import sglang.srt.plugins as sglang_plugins

    if not sglang_plugins._plugins_loaded:
        sglang_plugins.load_plugins()


class PrefillSteps:
    """What a prefill rank of either line does around upstream's PD prefill path.

    The line's class sets ``ctx`` (its CP group), ``queue`` (upstream's
    ``PrefillBootstrapQueue``), ``kv_manager``, ``baseline`` (from ``_resources``) and
    defines ``_resources()`` (what a finished request gives back) and ``_poll(req)`` (the
    CP-all-reduced poll).
    """

    def _leaks(self) -> List[str]:
        now = self._resources()
        return [f"{k}: {self.baseline[k]} -> {v}" for k, v in now.items() if v != self.baseline[k]]

    def _local_state(self, req: Any) -> str:
        """This rank's own view of ``req``'s transfer (before the CP all-reduce)."""
        room, mgr = req.bootstrap_room, self.kv_manager
        where = "in" if room in mgr.transfer_infos else "not in"
        return f"local status {mgr.request_status.get(room)}, decode metadata {where} transfer_infos"

    def _bootstrap(self, req: Any, deadline: float) -> bool:
        """Queue ``req``; poll upstream's bootstrap queue until decode's metadata reached
        every rank (True) or the request failed (False)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        self.queue.add(req, num_kv_heads=1)
        while True:
            if self.queue.pop_bootstrapped():
                return True
            if isinstance(req.finished_reason, FINISH_ABORT):
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.ctx.rank}: {req.rid} still bootstrapping; {self._local_state(req)}")
            time.sleep(_POLL_S)

    def _wait_done(self, req: Any, deadline: float) -> int:
        """The CP-wide poll until the transfer ends (Success or Failed)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        while (poll := self._poll(req)) not in (KVPoll.Success, KVPoll.Failed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.ctx.rank}: {req.rid} still transferring; {self._local_state(req)}")
            time.sleep(_POLL_S)
        return poll

    def _close_sender(self, req: Any, out: PrefillOutcome, poll: int) -> None:
        """After the CP-wide poll: the sender cleared, or the recorded failure read."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        out.success = poll == KVPoll.Success
        if out.success:
            req.disagg_kv_sender.clear()
            return
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as error:  # upstream raises the recorded reason
            out.failure = str(error)


class DecodeChecks:
    """A decode server of either line: receive a request through upstream's decode queues
    and check its bytes on the server's own pool.

    The line's class sets ``scenario``, ``ports``, ``errors`` (an :class:`ErrorLog`),
    ``prealloc_queue``, ``transfer_queue``, ``granted`` (pages ever granted), ``served``
    ((spec, locs) re-checked at the end), ``planted`` (the same, of planted requests: re-checked
    apart, so one cluster serves the negative controls beside the clean requests) and defines
    ``_new_req(spec)``, ``_locs(req, n)`` (the request's decode slots),
    ``_mismatches(spec, locs)`` ((target, draft) tokens),
    ``_aux_ok(spec, req)``, ``_release(req)`` (a checked request given back),
    ``_keep(spec, locs, req)`` (a checked request held for the final re-check) and
    ``_changed_pages()`` (per page, whether any byte left the sentinel).
    """

    page_size: int

    def serve(self, spec: PDRequest, keep: bool = True) -> DecodeOutcome:
        """Receive ``spec`` through upstream's queues; check its bytes on this pool.

        ``keep=False``: once checked, the request's KV pages and row go back (upstream's
        ``release_kv_cache``, as a request that finished decoding) and the end-of-run
        re-check skips it; its pages stay counted as granted for the sentinel check.
        """
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        # Later than the prefill ranks' deadline: a stuck transfer is reported by the side
        # that knows why.
        deadline = time.monotonic() + self.scenario.transfer_timeout_s + 15
        out = DecodeOutcome(spec.rid, success=False)
        errors_before = len(self.errors.messages)
        req = self._new_req(spec)
        self.prealloc_queue.add(req)
        started, transferred, locs = time.monotonic(), False, None
        while not isinstance(req.finished_reason, FINISH_ABORT):
            preallocated = _first(self.prealloc_queue.pop_preallocated())
            self.transfer_queue.extend(preallocated)
            if preallocated:
                locs = self._locs(req, len(spec.token_ids)).to(torch.int64).clone()
                pages = (locs // self.page_size).unique()
                self.granted.update(pages.tolist())
                out.granted_pages = len(pages)
                started = time.monotonic()
            if req in _first(self.transfer_queue.pop_transferred()):
                transferred = True
                break
            if time.monotonic() > deadline:
                status = self.prealloc_queue.kv_manager.request_status.get(spec.room)
                raise TimeoutError(
                    f"decode: {spec.rid} not transferred in time "
                    f"(preallocated: {locs is not None}, receiver status {status})"
                )
            time.sleep(_POLL_S)
        out.transfer_s = time.monotonic() - started
        out.errors_logged = self.errors.messages[errors_before:]
        if not transferred:
            out.failure = str(req.finished_reason.message)
            if locs is not None:
                pages = (locs // self.page_size).unique().numpy()
                out.granted_pages_touched = int(self._changed_pages()[pages].sum())
            return out
        out.success = True
        out.kv_mismatches, out.draft_mismatches = self._mismatches(spec, locs)
        out.aux_ok = self._aux_ok(spec, req)
        if keep:
            self._keep(spec, locs, req)
        else:
            self._release(req)
        return out

    def report(self, outcomes: List[DecodeOutcome]) -> DecodeReport:
        """End of run: every kept request re-checked, and every page never granted still
        holds the sentinel."""
        final = [self._mismatches(spec, locs) for spec, locs in self.served]
        planted = [self._mismatches(spec, locs) for spec, locs in self.planted]
        changed = self._changed_pages()
        off_grant = [p for p in changed.nonzero()[0].tolist() if p not in self.granted]
        return DecodeReport(
            outcomes=outcomes,
            final_kv_mismatches=sum(t for t, _ in final),
            final_draft_mismatches=sum(d for _, d in final),
            off_grant_pages_changed=len(off_grant),
            final_planted_kv_mismatches=sum(t for t, _ in planted),
        )


def _first(popped: Any) -> Any:
    """Upstream's queue pops return a list, or (list, extra) on some releases."""
    return popped[0] if isinstance(popped, tuple) else popped


# ------------------------------------------------------------------ the simulator's PD tests
#: ``SimConfig`` fields of both lines' simulator PD tests: small pools so the trace hits on
#: device and loads back from host; chunks and a retraction so the transfers cover a
#: finished chunked prefill and skip a retracted attempt; the main column only.
SIM_PD_SMALL_TRACE: Dict[str, Any] = dict(
    cp_size=2,
    seed=0,
    num_requests=12,
    physical_tokens=512,
    max_prompt_len=448,
    system_prompt_len=128,
    turn_len_min=32,
    turn_len_max=96,
    reply_len=32,
    chunked_prefill_size=128,
    retract_prob=0.1,
    baseline=False,
    native_column=False,
    pd=True,
    timeout_s=150,
)


# ------------------------------------------------------------------ engine and logs
def init_transfer_engine() -> Any:
    """This process's Mooncake transfer engine on loopback (TCP, ``MC_FORCE_TCP``)."""
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        init_mooncake_transfer_engine,
    )

    return init_mooncake_transfer_engine(hostname=LOOPBACK, gpu_id=0)


class SentBytesMeter:
    """Counts the bytes each ``batch_transfer_sync`` hands to the engine (delegates).

    Upstream calls the engine from its transfer thread pool, one call per layer at once
    (``mooncake/conn.py``, ``executor.submit``): the counts are updated under a lock, or
    concurrent ``+=`` would lose bytes.
    """

    def __init__(self, engine: Any):
        self.total = 0
        self.engine_s = 0.0
        self._lock = threading.Lock()
        original = engine.batch_transfer_sync

        def counted(session_id, buffers, peer_buffer_addresses, lengths):
            with self._lock:
                self.total += int(sum(lengths))
            start = time.monotonic()
            try:
                return original(session_id, buffers, peer_buffer_addresses, lengths)
            finally:
                with self._lock:
                    self.engine_s += time.monotonic() - start

        engine.batch_transfer_sync = counted


class ErrorLog(logging.Handler):
    """Collects the ERROR records of SGLang's disaggregation loggers."""

    def __init__(self):
        super().__init__(level=logging.ERROR)
        self.messages: List[str] = []
        logging.getLogger("sglang.srt.disaggregation").addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


__all__ = [
    "ALL_CP_RANKS_TRANSFER_ENV",
    "BootstrapUnreachable",
    "DecodeChecks",
    "DecodeOutcome",
    "DecodeReport",
    "ErrorLog",
    "EvictDevice",
    "GO",
    "LOOPBACK",
    "PDCluster",
    "PDEnv",
    "PDLine",
    "PDPorts",
    "PLANTS",
    "PDRequest",
    "PrefillOutcome",
    "PrefillSteps",
    "REGISTERED",
    "RoleChannel",
    "RoleFailed",
    "RoleProcess",
    "SENTINEL_BYTE",
    "SIM_PD_SMALL_TRACE",
    "ScenarioSteps",
    "SentBytesMeter",
    "Step",
    "free_port",
    "hold_if_asked",
    "init_transfer_engine",
    "load_plugins",
    "prefill_names",
    "prefill_startup_failure",
    "role_env",
    "run_fault_cluster",
    "run_pd_cluster",
    "serve_bootstrap",
    "wait_prefill_registered",
    "wait_registered",
    "wait_until_serving",
]
