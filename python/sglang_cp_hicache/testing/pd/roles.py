"""PD role processes on loopback: each role a process from the CPU runtime's forkserver
(SGLang already imported there) with its own environment (:func:`role_env`: SGLang's Mooncake
backend on loopback TCP), a pipe to the harness (:class:`RoleChannel`, :class:`RoleProcess`),
bounded waits, and :class:`PDCluster`, which kills whatever still runs when it closes.

SGLang's PD threads (prefill bootstrap, decode, heartbeat) are non-daemon and block on ZMQ
forever, so a role never returns through the interpreter's shutdown: its process reports
and ends with ``os._exit``. A watchdog ends it after its lifetime even if no one kills it.

:func:`serve_bootstrap` is the bootstrap server's role (upstream's
``MooncakeKVBootstrapServer``, as the prefill server's main process runs it)."""

from __future__ import annotations

import multiprocessing.connection
import os
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import requests

from sglang_cp_hicache.testing.dist import (
    _free_port,
    _function_ref,
    _get_context,
    _resolve_function,
)


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

    def checkpoint(self, name: str, payload: Any = None) -> Any:
        """Report ``name`` and block until the harness answers it (its reply's payload), 60 s
        at most."""
        self.event(name, payload)
        return self.wait(name, 60.0)

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

    def start_bootstrap(self) -> RoleProcess:
        """The bootstrap server's process; returns once it answers its health check (30 s
        at most for each of its two signs)."""
        role = self.start("bootstrap", serve_bootstrap, LOOPBACK, self.ports.bootstrap, self.lifetime_s)
        role.wait_event("serving", 30.0)
        wait_until_serving(LOOPBACK, self.ports.bootstrap, 30.0)
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


__all__ = [
    "ALL_CP_RANKS_TRANSFER_ENV",
    "BootstrapUnreachable",
    "GO",
    "LOOPBACK",
    "PDCluster",
    "PDEnv",
    "PDPorts",
    "REGISTERED",
    "RoleChannel",
    "RoleFailed",
    "RoleProcess",
    "free_port",
    "role_env",
    "serve_bootstrap",
    "wait_prefill_registered",
    "wait_until_serving",
]
