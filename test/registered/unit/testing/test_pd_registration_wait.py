"""The PD harness's registration wait (``testing/pd/``) against upstream's real Mooncake
bootstrap server, in both venvs.

A prefill role that reports ``registered`` without its KV manager's PUT ever reaching the
bootstrap server (a plugin hook that swallowed upstream's registration) must fail the
cluster's wait at once, naming the bootstrap server: before, the decode started, found no
prefill and the PD tests hung for about 15 minutes of request timeouts. A prefill that did
register (upstream's PUT of one cp-1 rank's row) passes the same wait.
"""

from __future__ import annotations

import pytest
import requests

from sglang_cp_hicache.testing.pd.cluster import wait_registered
from sglang_cp_hicache.testing.pd.roles import (
    LOOPBACK,
    PDCluster,
    REGISTERED,
    RoleChannel,
    RoleFailed,
)

#: The row upstream's ``register_to_bootstrap`` PUTs for a one-rank prefill (the fields
#: both lines' ``/route`` PUT handler reads).
ONE_RANK_ROW = {
    "attn_tp_size": 1, "attn_tp_rank": 0, "attn_cp_size": 1, "attn_cp_rank": 0,
    "attn_dp_size": 1, "attn_dp_rank": 0, "pp_size": 1, "pp_rank": 0,
    "system_dp_size": 1, "system_dp_rank": 0, "rank_ip": LOOPBACK, "rank_port": 1,
    "page_size": 64, "kv_cache_dtype": "bfloat16",
}  # fmt: skip


def _reports_registered(channel: RoleChannel, bootstrap_port: int, put: bool) -> None:
    """Role: a prefill rank that reports ``registered``, having PUT its row or not."""
    if put:
        response = requests.put(f"http://{LOOPBACK}:{bootstrap_port}/route", json=ONE_RANK_ROW, timeout=5)
        response.raise_for_status()
    channel.event(REGISTERED)
    channel.wait("stop", timeout_s=60.0)


@pytest.mark.parametrize("put", [False, True], ids=["never_registered", "registered"])
def test_the_wait_fails_naming_the_bootstrap_unless_the_prefill_registered(put: bool) -> None:
    with PDCluster(lifetime_s=90.0) as cluster:
        cluster.start_bootstrap()
        cluster.start("prefill0", _reports_registered, cluster.ports.bootstrap, put)
        if put:
            wait_registered(cluster, ["prefill0"], timeout_s=60.0)
        else:
            with pytest.raises(RoleFailed, match=f"bootstrap server {LOOPBACK}:{cluster.ports.bootstrap}"):
                wait_registered(cluster, ["prefill0"], timeout_s=60.0)
        cluster.roles["prefill0"].reply("stop")
