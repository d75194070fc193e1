"""What the serving harness's client tests share: an HTTP server on loopback answering
with a handler class of the test's, in a thread, shut down after the test."""

from __future__ import annotations

import http.server
import threading
from typing import Callable, List, Type

import pytest


@pytest.fixture()
def fake_http() -> Callable[[Type[http.server.BaseHTTPRequestHandler]], str]:
    """``fake_http(handler)``: the URL of a server answering with ``handler``."""
    servers: List[http.server.ThreadingHTTPServer] = []

    def serve(handler: Type[http.server.BaseHTTPRequestHandler]) -> str:
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}"

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()
