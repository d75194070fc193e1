"""The command line of a ``mooncake_master`` on loopback, for every harness that starts one
(the cache-stack tests' ``testing/v0_5_23/mooncake_store.MooncakeMaster``, the serving harness),
and of a segment holder beside it (the serving harness's fleet)."""

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


def holder_argv(master_address: str, port: int, segment_bytes: int) -> List[str]:
    """A Mooncake segment holder: ``mooncake_client`` (Mooncake's standalone client service)
    on loopback mounting ``segment_bytes`` of the store and no local buffer, TCP, no metadata
    server. The master places objects in any mounted segment, so prefills that mount none
    (``global_segment_size`` 0) keep theirs here, and it outlives any of them."""
    binary = shutil.which("mooncake_client") or os.path.join(os.path.dirname(sys.executable), "mooncake_client")
    return [binary, "--host=127.0.0.1", f"--port={port}", f"--global_segment_size={segment_bytes}",
            "--local_buffer_size=0", f"--master_server_address={master_address}",
            "--metadata_server=P2PHANDSHAKE", "--protocol=tcp"]  # fmt: skip


__all__ = ["holder_argv", "master_argv"]
