"""Whether a PD bootstrap server accepts connections, waited for within a bound.

A prefill server under CP shared KV that cannot reach its bootstrap server must stop at
startup, naming the address: SGLang's own registration retries for about 15 s, logs the
cause and serves on unregistered, so every request would later fail by timeout with no
word of the address. Pure Python (sockets only), shared by both lines' hooks.
"""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

#: How long a prefill rank waits for its bootstrap server to accept a connection before
#: it stops. The server is started by the prefill's own main process before the model
#: loads, so it is up long before a scheduler registers; the bound only covers a slow start.
REGISTRATION_WAIT_S = 10.0
_RETRY_S = 0.25


class PDBootstrapUnreachable(RuntimeError):
    """The PD bootstrap server did not accept a connection within the bound."""


def bootstrap_address(url: str) -> tuple:
    """(host, port) of a bootstrap URL such as ``http://127.0.0.1:8998/route``."""
    parts = urlsplit(url)
    if parts.hostname is None or parts.port is None:
        raise ValueError(f"PD bootstrap URL without host:port: {url!r}")
    return parts.hostname, parts.port


def wait_until_reachable(host: str, port: int, timeout_s: float = REGISTRATION_WAIT_S) -> None:
    """Return once ``host:port`` accepts a TCP connection; raise
    :class:`PDBootstrapUnreachable` naming it after ``timeout_s`` (the last cause included)."""
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        try:
            with socket.create_connection((host, port), timeout=max(0.05, min(1.0, remaining))):
                return
        except OSError as error:
            cause = error
        if time.monotonic() + _RETRY_S >= deadline:
            break
        time.sleep(_RETRY_S)
    raise PDBootstrapUnreachable(
        f"PD prefill: bootstrap server {host}:{port} did not accept a connection within "
        f"{timeout_s:.0f} s ({cause}); start it there or fix --disaggregation-bootstrap-port / "
        "the host (a prefill that cannot register would fail every request by timeout)"
    )


__all__ = ["PDBootstrapUnreachable", "REGISTRATION_WAIT_S", "bootstrap_address", "wait_until_reachable"]
