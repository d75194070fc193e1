"""The command line of a ``mooncake_master`` on loopback, for every harness that starts one
(the cache-stack tests' ``testing/v0_5_23/mooncake_store.MooncakeMaster``, the serving harness)."""

from __future__ import annotations

import os
import shutil
import sys
from typing import List, Optional


def master_argv(rpc_port: int, metrics_port: int, lease_ttl_ms: Optional[int] = None) -> List[str]:
    """TCP on 127.0.0.1, no metadata server (clients use P2PHANDSHAKE), two RPC threads, no
    metric reporting; ``lease_ttl_ms``: how long a read object stays leased (None: the
    master's default)."""
    binary = shutil.which("mooncake_master") or os.path.join(os.path.dirname(sys.executable), "mooncake_master")
    argv = [binary, "--rpc_address=127.0.0.1", f"--rpc_port={rpc_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={metrics_port}",
            "--rpc_thread_num=2", "--enable_metric_reporting=false"]  # fmt: skip
    if lease_ttl_ms is not None:
        argv.append(f"--default_kv_lease_ttl={lease_ttl_ms}")
    return argv


__all__ = ["master_argv"]
