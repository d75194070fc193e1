"""``testing/v0_5_23/storage.py``'s loopback processes (Mooncake master, held segment): started
once they listen, and ended when they exit or never listen, with the error raised."""

from __future__ import annotations

import socket
import sys

import pytest

from sglang_cp_hicache.testing.v0_5_23.mooncake_store import _start_listening, free_ports


def _python(body: str) -> list:
    return [sys.executable, "-c", body]


def test_a_process_is_returned_once_it_listens_and_ends_with_end():
    from sglang_cp_hicache.testing.v0_5_23.mooncake_store import _end

    port = free_ports(1)[0]
    body = f"import socket, time; s = socket.socket(); s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(60)"
    process = _start_listening(_python(body), port, "listener", 30.0)
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass
    finally:
        _end(process)
    assert process.poll() is not None


def test_a_process_that_exits_first_is_named_with_its_code():
    with pytest.raises(RuntimeError, match="quitter exited with 3"):
        _start_listening(_python("raise SystemExit(3)"), free_ports(1)[0], "quitter", 30.0)


def test_a_process_that_never_listens_is_ended(monkeypatch):
    started = []
    import subprocess

    popen = subprocess.Popen
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: started.append(popen(*a, **k)) or started[-1])
    with pytest.raises(TimeoutError, match="silent did not listen"):
        _start_listening(_python("import time; time.sleep(60)"), free_ports(1)[0], "silent", 1.0)
    assert started and started[0].poll() is not None  # not left running
