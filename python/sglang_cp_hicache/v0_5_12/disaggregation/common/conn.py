"""``CommonKVManager.register_to_bootstrap`` under CP shared KV: a prefill rank whose
bootstrap server is unreachable stops at startup, naming the address.

Upstream (``disaggregation/common/conn.py``, ``register_to_bootstrap``) tries the PUT 5
times with a 1-2-4-8 s backoff, logs "Connection refused" without the address, then one
ERROR, and lets the server run unregistered: every request then fails at bootstrap by
timeout. AROUND it, under the flag, the rank first waits a bounded time for the bootstrap
address to accept a connection
(:func:`~sglang_cp_hicache.core.bootstrap_probe.wait_until_reachable`) and raises
``PDBootstrapUnreachable`` naming ``host:port`` if it never does; a reachable server gets
upstream's registration, unchanged.

Flag off: upstream's method, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sglang_cp_hicache.core import bootstrap_probe
from sglang_cp_hicache.core.bootstrap_probe import wait_until_reachable
from sglang_cp_hicache.v0_5_12.server_args import is_cp_shared_kv_enabled


def bootstrap_host(manager: Any) -> str:
    """The host upstream registers with: the multi-node ``dist_init_addr``'s, else the
    server's own (``register_to_bootstrap``'s choice)."""
    if manager.dist_init_addr:
        from sglang.srt.utils.network import NetworkAddress

        return NetworkAddress.parse(manager.dist_init_addr).resolved().host
    return manager.bootstrap_host


def register_to_bootstrap_around(original: Callable, manager: Any, *args: Any, **kwargs: Any) -> None:
    if is_cp_shared_kv_enabled(manager.server_args):
        wait_until_reachable(
            bootstrap_host(manager), manager.bootstrap_port, timeout_s=bootstrap_probe.REGISTRATION_WAIT_S
        )
    return original(manager, *args, **kwargs)
