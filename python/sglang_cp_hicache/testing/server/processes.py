"""Processes the serving harness starts: each in its own session (process group), its output
in a log file, every wait bounded, ended by its group, and checked to be gone.

A :class:`ManagedProcess` is one command (an SGLang server, the router, a Mooncake master).
:meth:`ManagedProcess.wait_ready` polls its readiness probe until it answers, the process
dies (its log's tail in the error) or the wait runs out. :meth:`ManagedProcess.stop` sends
SIGTERM to the group, SIGKILL after a grace period, and raises :class:`ProcessLeak` if any
member of the group is still there afterwards.
"""

from __future__ import annotations

import json
import logging
import os
import random
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

logger = logging.getLogger(__name__)

LOOPBACK = "127.0.0.1"
LOG_TAIL_LINES = 40


class ProcessDied(RuntimeError):
    """A process ended before it was ready; the message carries its log's tail."""


class NotReady(TimeoutError):
    """A process did not become ready within its bounded wait."""


class ProcessLeak(RuntimeError):
    """A member of a stopped process group is still running."""


#: Ports handed out: below the kernel's ephemeral range (what the OS gives a client socket)
#: and 10000 under 65536 (SGLang 0.5.12 derives its gRPC port as ``--port + 10000``).
PORT_RANGE = (20000, 32000)


def free_ports(count: int) -> List[int]:
    """``count`` distinct loopback ports in :data:`PORT_RANGE` nobody listens on right now."""
    rng = random.Random()
    ports: List[int] = []
    while len(ports) < count:
        port = rng.randrange(*PORT_RANGE)
        if port in ports:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((LOOPBACK, port))
            except OSError:
                continue
        ports.append(port)
    return ports


def http_status(url: str, timeout_s: float = 2.0) -> Optional[int]:
    """The HTTP status of ``GET url`` (None when nothing answers)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except (OSError, ValueError):
        return None


def http_json(url: str, timeout_s: float = 5.0) -> Optional[dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return json.loads(response.read().decode())
    except (OSError, ValueError):
        return None


def healthy(url: str) -> Callable[[], bool]:
    """Readiness of an SGLang server: ``GET /health`` answers 200."""
    return lambda: http_status(f"{url}/health") == 200


def router_ready(url: str, workers: int) -> Callable[[], bool]:
    """Readiness of an sglang-router: ``/readiness`` reports every worker healthy (its
    ``/health`` answers before the workers are activated)."""

    def probe() -> bool:
        body = http_json(f"{url}/readiness")
        return bool(body) and body.get("healthy_workers") == workers == body.get("total_workers")

    return probe


def port_listening(port: int) -> Callable[[], bool]:
    def probe() -> bool:
        with socket.socket() as sock:
            return sock.connect_ex((LOOPBACK, port)) == 0

    return probe


class ManagedProcess:
    """One command in its own process group, logged, bounded, ended by its group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Dict[str, str],
        log_path: Path,
        ready: Callable[[], bool],
        ready_within_s: float,
    ):
        self.name = name
        self.ready_within_s = ready_within_s
        self.argv = list(argv)
        self.env = dict(env)
        self.log_path = log_path
        self._ready = ready
        self._popen: Optional[subprocess.Popen] = None
        self.started_at = 0.0
        self.ready_after_s: Optional[float] = None

    @property
    def pid(self) -> Optional[int]:
        return None if self._popen is None else self._popen.pid

    def start(self) -> "ManagedProcess":
        if self._popen is not None:
            raise RuntimeError(f"{self.name} is already started")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._popen = subprocess.Popen(
                self.argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=self.env,
                start_new_session=True,  # its own group: stop() ends every child with it
            )
        self.started_at = time.monotonic()
        logger.info("started %s (pid %d): %s", self.name, self._popen.pid, " ".join(self.argv))
        return self

    def running(self) -> bool:
        return self._popen is not None and self._popen.poll() is None

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def log_text(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def wait_ready(self, poll_s: float = 0.5) -> float:
        """Block until ready, at most ``ready_within_s``; the seconds since start. Raises
        :class:`ProcessDied` or :class:`NotReady` (the process is left running; :meth:`stop`
        ends it)."""
        timeout_s = self.ready_within_s
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.running():
                code = None if self._popen is None else self._popen.returncode
                raise ProcessDied(f"{self.name} exited with {code} before it was ready:\n{self.log_tail()}")
            if self._ready():
                self.ready_after_s = time.monotonic() - self.started_at
                logger.info("%s ready after %.1f s", self.name, self.ready_after_s)
                return self.ready_after_s
            if time.monotonic() >= deadline:
                raise NotReady(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.log_tail()}")
            time.sleep(poll_s)

    def _group_alive(self) -> bool:
        try:
            os.killpg(self._popen.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self._popen.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self, grace_s: float = 15.0) -> None:
        """End the process group: SIGTERM, SIGKILL after ``grace_s``; raise
        :class:`ProcessLeak` if a member survives SIGKILL."""
        if self._popen is None:
            return
        self._signal_group(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while self._group_alive() and time.monotonic() < deadline:
            self._popen.poll()
            time.sleep(0.2)
        if self._group_alive():
            logger.warning("%s: SIGKILL after %.0f s", self.name, grace_s)
            self._signal_group(signal.SIGKILL)
            deadline = time.monotonic() + 10.0
            while self._group_alive() and time.monotonic() < deadline:
                self._popen.poll()
                time.sleep(0.1)
        try:
            self._popen.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        leaked = self._group_alive()
        pid, self._popen = self._popen.pid, None
        if leaked:
            raise ProcessLeak(f"{self.name}: process group {pid} still has members after SIGKILL")
        logger.info("%s (group %d) ended", self.name, pid)

    def kill(self) -> None:
        """SIGKILL the group at once (a fault scenario); :meth:`stop` still checks it."""
        if self._popen is not None:
            self._signal_group(signal.SIGKILL)


__all__ = [
    "LOOPBACK",
    "ManagedProcess",
    "NotReady",
    "ProcessDied",
    "ProcessLeak",
    "free_ports",
    "healthy",
    "http_json",
    "http_status",
    "port_listening",
    "router_ready",
]
