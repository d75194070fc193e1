"""``core.bootstrap_probe``: a PD prefill's bounded wait for its bootstrap server."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from sglang_cp_hicache.core.bootstrap_probe import (
    PDBootstrapUnreachable,
    bootstrap_address,
    wait_until_reachable,
)


def _unused_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_an_unreachable_server_raises_naming_it_within_the_bound() -> None:
    port = _unused_port()
    start = time.monotonic()
    with pytest.raises(PDBootstrapUnreachable, match=f"127.0.0.1:{port}"):
        wait_until_reachable("127.0.0.1", port, timeout_s=0.6)
    assert 0.3 <= time.monotonic() - start < 3.0


def test_a_server_that_starts_within_the_bound_is_waited_for() -> None:
    port = _unused_port()
    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)

    def listen_late() -> None:
        time.sleep(0.4)
        server.bind(("127.0.0.1", port))
        server.listen()

    thread = threading.Thread(target=listen_late)
    thread.start()
    try:
        wait_until_reachable("127.0.0.1", port, timeout_s=5.0)
    finally:
        thread.join()
        server.close()


def test_bootstrap_address_of_a_route_url() -> None:
    assert bootstrap_address("http://127.0.0.1:8998/route") == ("127.0.0.1", 8998)
    assert bootstrap_address("http://[::1]:9000/route") == ("::1", 9000)
    with pytest.raises(ValueError, match="without host:port"):
        bootstrap_address("http://127.0.0.1/route")
