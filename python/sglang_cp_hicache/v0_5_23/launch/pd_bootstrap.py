"""``CommonKVManager._register_topology_row`` under CP shared KV: a prefill rank whose
bootstrap server is unreachable stops at startup, naming the address.

Upstream (``disaggregation/common/conn.py``, ``_register_topology_row``) tries the PUT 5
times with a 1-2-4-8 s backoff, logs each cause, then one ERROR without the URL, and lets
the server run unregistered: every request then fails at bootstrap by timeout. AROUND it,
under the flag, the rank first waits a bounded time for the address to accept a connection
(:func:`~sglang_cp_hicache.core.bootstrap_probe.wait_until_reachable`) and raises
``PDBootstrapUnreachable`` naming ``host:port`` if it never does; a reachable server gets
upstream's registration, unchanged.

Flag off: upstream's method, unchanged.
"""

from __future__ import annotations

from typing import Any, Callable, Dict

from sglang_cp_hicache.core import bootstrap_probe
from sglang_cp_hicache.core.bootstrap_probe import bootstrap_address, wait_until_reachable
from sglang_cp_hicache.v0_5_23.launch.cp_mode import cp_mode


def register_topology_row_around(
    original: Callable, manager: Any, url: str, payload: Dict, *args: Any, **kwargs: Any
) -> None:
    from sglang.srt.runtime_context import get_server_args

    if cp_mode(get_server_args()).shards_kv:  # startup: once per registration
        wait_until_reachable(*bootstrap_address(url), timeout_s=bootstrap_probe.REGISTRATION_WAIT_S)
    return original(manager, url, payload, *args, **kwargs)
