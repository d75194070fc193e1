"""Mooncake store processes for the 0.5.23 L3 tests, all on loopback: a ``mooncake_master``
(:class:`MooncakeMaster`), a segment held by a ``mooncake_client`` so the store outlives its
writers (:class:`MooncakeSegmentHolder`, :func:`held_mooncake_store`), free ports, and
writer ranks held alive, one per process, until their readers are done (:class:`HeldRanks`).
Every process is started bounded and ended by whoever started it."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Iterator, List, Optional, Tuple


# ------------------------------------------------------------ a local Mooncake master
def _start_listening(argv: List[str], port: int, name: str, timeout_s: float) -> Any:
    """``argv`` started, once it accepts connections on loopback ``port``; ended, and the
    error raised, if it exits or ``timeout_s`` passes first."""
    import subprocess

    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_listening(process, port, name, timeout_s)
    except BaseException:
        _end(process)
        raise
    return process


def _wait_listening(process: Any, port: int, name: str, timeout_s: float) -> None:
    """Until ``process`` accepts connections on loopback ``port``; raises if it exits or
    ``timeout_s`` passes first."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with {process.returncode}")
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"{name} did not listen on 127.0.0.1:{port}")


def _end(process: Any) -> None:
    """Terminate ``process`` (killed if it outlives 5 s); nothing if it already exited."""
    if process is not None and process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=5)
        except Exception:
            process.kill()
            process.wait(timeout=5)


@dataclass
class MooncakeMaster:
    """``mooncake_master`` on loopback (TCP, no metadata server: clients use
    P2PHANDSHAKE), started by :meth:`start`, always stopped by :meth:`stop` (by its pid)."""

    rpc_port: int
    metrics_port: int
    # How long a read object stays leased (unevictable). The eviction tests want it short;
    # the simulator's masters a longer one: at load 40+ upstream's startup warm-up outlived
    # 50 ms and failed with LEASE_EXPIRED.
    lease_ttl_ms: int = 50
    process: Any = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    def client_config(self, segment_bytes: int = 32 << 20) -> dict:
        """The store backend's extra config for a client of this master."""
        return {
            "master_server_address": self.address,
            "protocol": "tcp",
            "metadata_server": "P2PHANDSHAKE",
            "local_hostname": "127.0.0.1",
            "global_segment_size": segment_bytes,
            "check_server": False,
        }

    def start(self, timeout_s: float = 10.0) -> "MooncakeMaster":
        from sglang_cp_hicache.testing.mooncake_master import master_argv

        argv = master_argv(self.rpc_port, self.metrics_port, self.lease_ttl_ms)
        self.process = _start_listening(argv, self.rpc_port, "mooncake_master", timeout_s)
        return self

    def stop(self) -> None:
        _end(self.process)
        self.process = None

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass
class MooncakeSegmentHolder:
    """A ``mooncake_client`` on loopback that mounts one segment of ``segment_bytes`` on
    ``master`` and holds it until :meth:`stop` (by its pid): objects placed there outlive
    the clients that put them, so a later run, at another cp size, reads them (clients
    that mount no segment of their own, ``global_segment_size`` 0, place every object
    in the held one)."""

    master: str  # the master's host:port
    port: int
    segment_bytes: int = 1 << 30
    process: Any = None

    def start(self, timeout_s: float = 10.0) -> "MooncakeSegmentHolder":
        binary = os.path.join(os.path.dirname(sys.executable), "mooncake_client")
        argv = [binary, f"--master_server_address={self.master}", "--metadata_server=P2PHANDSHAKE",
                "--host=127.0.0.1", f"--port={self.port}", "--protocol=tcp",
                f"--global_segment_size={self.segment_bytes >> 20}MB"]  # fmt: skip
        # the client listens once its segment is mounted
        self.process = _start_listening(argv, self.port, "mooncake_client", timeout_s)
        return self

    def stop(self) -> None:
        _end(self.process)
        self.process = None


@contextlib.contextmanager
def held_mooncake_store(segment_bytes: int = 1 << 30) -> Iterator[str]:
    """A Mooncake store that outlives its clients: a master on loopback and one held
    segment; yields the master's address. Both stopped (by pid) on exit."""
    with MooncakeMaster(*free_ports(2), lease_ttl_ms=5000) as master:
        holder = MooncakeSegmentHolder(master.address, free_ports(1)[0], segment_bytes).start()
        try:
            yield master.address
        finally:
            holder.stop()


def free_ports(count: int) -> List[int]:
    """``count`` free loopback TCP ports (bound and released; the OS does not reuse
    them at once)."""
    import socket

    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


# ------------------------------------ writers held alive for later readers (Mooncake)
#: A held rank's poll of its release file.
HOLD_POLL_S = 0.05


def _ready_path(flag_dir: str, rank: int) -> str:
    return os.path.join(flag_dir, f"ready.{rank}")


def _release_path(flag_dir: str) -> str:
    return os.path.join(flag_dir, "release")


def hold_until_released(rank: int, flag_dir: str, timeout_s: float) -> float:
    """Rank side of :class:`HeldRanks`: announce this rank's work done, then wait until the
    test releases the ranks (a file, no collective: held ranks make no cache calls); the
    seconds held. Raises ``TimeoutError`` after ``timeout_s``: a hold never outlives its
    test."""
    ready = _ready_path(flag_dir, rank)
    with open(ready + ".tmp", "w"):
        pass
    os.replace(ready + ".tmp", ready)  # atomic: the test never sees a half-made flag
    started = time.monotonic()
    while not os.path.exists(_release_path(flag_dir)):
        if time.monotonic() - started > timeout_s:
            raise TimeoutError(f"rank {rank}: not released within {timeout_s} s")
        time.sleep(HOLD_POLL_S)
    return time.monotonic() - started


@dataclass
class HeldRanks:
    """:func:`~sglang_cp_hicache.testing.dist.run_ranks` in a background thread, for ranks
    that must stay alive while other ranks run: Mooncake keeps an object in the segments
    of the clients mounted when it was put, so a writer that leaves takes its pages with it.

    ``fn(ctx, flag_dir, hold_s, *args)`` does its work, then calls
    :func:`hold_until_released`. Entering waits (at most ``ready_timeout_s``) until every
    rank announced; leaving releases them and joins the thread (bounded). :meth:`results`
    are the ranks' reports, or raises their failure. Invariant: a rank is never held longer
    than ``hold_s``, and the thread never outlives the run's own timeout.
    """

    world_size: int
    fn: Any
    args: Tuple[Any, ...]
    flag_dir: str
    hold_s: float = 240.0
    ready_timeout_s: float = 120.0
    _thread: Any = None
    _results: Optional[List[Any]] = None
    _error: Optional[BaseException] = None

    def _run(self) -> None:
        from sglang_cp_hicache.testing.dist import run_ranks

        try:
            self._results = run_ranks(
                self.world_size, self.fn, self.flag_dir, self.hold_s, *self.args,
                timeout_s=self.ready_timeout_s + self.hold_s,
            )  # fmt: skip
        except BaseException as error:  # re-raised by results()
            self._error = error

    def __enter__(self) -> "HeldRanks":
        import threading

        os.makedirs(self.flag_dir, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="held-ranks", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + self.ready_timeout_s
        ready = [_ready_path(self.flag_dir, rank) for rank in range(self.world_size)]
        while not all(os.path.exists(path) for path in ready):
            if not self._thread.is_alive():
                self.results()  # raises the ranks' failure
                raise RuntimeError("held ranks ended without announcing they were ready")
            if time.monotonic() > deadline:
                self.__exit__()
                raise TimeoutError(f"held ranks not ready within {self.ready_timeout_s} s")
            time.sleep(HOLD_POLL_S)
        return self

    def __exit__(self, *exc: object) -> None:
        with open(_release_path(self.flag_dir), "w"):
            pass
        # run_ranks ends by its own timeout at the latest; a hung thread is a failure.
        self._thread.join(timeout=self.ready_timeout_s + self.hold_s + 30)
        if self._thread.is_alive() and self._error is None:
            self._error = TimeoutError("held ranks' run did not end after their release")

    def results(self) -> List[Any]:
        if self._error is not None:
            raise self._error
        if self._results is None:
            raise RuntimeError("held ranks have not ended: results() after leaving the block")
        return self._results


__all__ = [
    "free_ports",
    "held_mooncake_store",
    "HeldRanks",
    "HOLD_POLL_S",
    "hold_until_released",
    "MooncakeMaster",
    "MooncakeSegmentHolder",
]
