"""What the serving harness launches: server specs, their command lines and environments.

Line-agnostic: each SGLang line spells its flags in ``testing/<line>/server_launch.py``
(:class:`LineLaunch`), chosen by the installed release (:func:`line_launch`). Capacities are
*logical* (what the scheduler and radix tree see): a sharded prefill of CP size ``cp`` is given
``logical / cp`` physical tokens per rank, so the sharded server and its unsharded reference
evict at the same logical fill.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Protocol, Sequence, Tuple

from sglang_cp_hicache.testing.server.runtime import RUNTIME_ENV

CONTEXT_LENGTH = 2048
PAGE_SIZE = 64
LOGICAL_TOKENS = 4096  # each prefill's logical device capacity (64 pages)
DECODE_TOKENS = 8192
CHUNKED_PREFILL_SIZE = 512  # a prompt of more than 512 tokens is prefilled in chunks
#: Host pool over device pool: 4x keeps a scenario's pages on host while fillers evict the
#: device (a fixed --hicache-size of 1 GB per rank took 2 GB of the box per TP 2 server).
HICACHE_RATIO = 4
ROUTER_REQUEST_TIMEOUT_S = 180
#: Set to "1" for an unsharded CP prefill with an L3 tier: the 0.5.23 runtime then lets every
#: CP rank write its own pages (``testing/v0_5_23/server_runtime.py``; upstream keys L3 pages
#: by CP rank but lets only TP rank 0 of an MLA model write, so they never read back).
UNSHARDED_CP_L3_WRITERS_ENV = "SGLANG_CP_HICACHE_UNSHARDED_CP_L3_WRITERS"
#: Set to "1" for a prefill whose Mooncake L3 puts the harness reads from its log: the 0.5.23
#: runtime then logs every batch of objects each rank puts, by key (the fleet scenario).
L3_PUTS_LOGGED_ENV = "SGLANG_CP_HICACHE_L3_PUTS_LOGGED"


@dataclass(frozen=True)
class StorageSpec:
    """An L3 tier: ``file`` in ``directory``, or ``mooncake`` on a harness master."""

    backend: str
    directory: Optional[Path] = None
    mooncake_master: Optional[str] = None  # host:port
    #: the segment each rank of a ``mooncake`` prefill mounts (None: the line's default); 0
    #: mounts none, so its objects live in other clients' segments (a segment holder's)
    mooncake_segment_bytes: Optional[int] = None

    def env(self) -> Dict[str, str]:
        if self.backend == "file":
            return {"SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR": str(self.directory)}
        return {}


@dataclass(frozen=True)
class PrefillSpec:
    """One PD prefill server. ``sharded``: the plugin's flag (CP shared KV)."""

    name: str
    tp: int = 2
    sharded: bool = True
    mem_layout: str = "layer_first"
    storage: Optional[StorageSpec] = None
    logical_tokens: int = LOGICAL_TOKENS
    extra_args: Tuple[str, ...] = ()
    kv_events: bool = False  # a KV event publisher (--kv-events-config) on a port of its own
    l3_puts_logged: bool = False  # its ranks log each L3 put by key (:data:`L3_PUTS_LOGGED_ENV`)
    extra_env: Tuple[Tuple[str, str], ...] = ()  # more environment (e.g. a fleet's health endpoint)

    @property
    def cp(self) -> int:
        return self.tp

    @property
    def max_total_tokens(self) -> int:
        return self.logical_tokens // self.cp if self.sharded and self.cp > 1 else self.logical_tokens

    def env(self) -> Dict[str, str]:
        """What this prefill's environment adds: its L3 tier's, for an unsharded CP prefill
        with one :data:`UNSHARDED_CP_L3_WRITERS_ENV`, :data:`L3_PUTS_LOGGED_ENV` if asked, and
        ``extra_env``."""
        if self.storage is None:
            return dict(self.extra_env)
        writers = {UNSHARDED_CP_L3_WRITERS_ENV: "1"} if not self.sharded and self.cp > 1 else {}
        puts = {L3_PUTS_LOGGED_ENV: "1"} if self.l3_puts_logged else {}
        return {**self.storage.env(), **writers, **puts, **dict(self.extra_env)}


@dataclass(frozen=True)
class Endpoint:
    """A server's loopback address and ports (``host``: another loopback address for a
    second "node", ``two_nodes.py``)."""

    port: int
    bootstrap_port: int = 0
    kv_events_port: int = 0  # 0: no KV event publisher
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def kv_events_url(self) -> str:
        """The KV event publisher's ZMQ endpoint (a SUB connects here)."""
        return f"tcp://127.0.0.1:{self.kv_events_port}"


class LineLaunch(Protocol):
    """How one SGLang line spells the harness's servers."""

    release: str
    supports_storage_under_flag: bool
    lane_decisions_logged: bool
    #: the flag's prefill publishes the plugin's own ``sglang:cp_hicache_*`` series
    plugin_metrics: bool
    #: upstream's cache series of the flag's prefill checked against the reference's
    #: (``testing/server/cache_metrics_check.py``)
    upstream_cache_metrics_compared: bool
    #: the main cluster's prefills publish KV events (``--kv-events-config``)
    publishes_kv_events: bool
    #: TP size of an extra unsharded reference for the decode tokens, where the line's
    #: unsharded CP reference is exact for the first token only (None: exact for all).
    decode_reference_tp: Optional[int]
    #: The flag's server refuses (HTTP 400) requests upstream would serve wrongly or die on
    #: (token ids outside the vocabulary, ...: the 0.5.23 line's ``admission`` room).
    refuses_unservable_requests: bool
    #: Upstream builds its page-hash extension at the first L3 query (``hicache_hash_cpp``):
    #: the harness builds it before any request (``jit_prebuild.py``). False where the
    #: release has no such extension.
    lazy_page_hash_extension: bool

    def model_args(self, decode: bool) -> List[str]:
        """The attention backend flags of a prefill (``decode=False``) or decode server."""

    def prefill_cp_args(self, spec: PrefillSpec) -> List[str]:
        """Prefill context parallelism and the plugin's flag."""

    def storage_args(self, storage: StorageSpec) -> List[str]:
        """The L3 tier's flags."""


def line_launch() -> LineLaunch:
    """The installed release's :class:`LineLaunch`."""
    from sglang_cp_hicache.core.releases import line_package

    line = line_package().rsplit(".", 1)[1]
    return importlib.import_module(f"sglang_cp_hicache.testing.{line}.server_launch").LAUNCH


def omp_binding(tp: int) -> str:
    """``SGLANG_CPU_OMP_THREADS_BIND``: one core per TP rank, wrapping on small boxes."""
    cores = os.cpu_count() or 1
    return "|".join(str(rank % cores) for rank in range(tp))


#: uvicorn's keep-alive for idle connections (``SGLANG_TIMEOUT_KEEP_ALIVE``, default 5 s), set
#: above sglang-router's own idle-connection timeout so that the router always closes an idle
#: connection first. With 5 s the server may close one just as the router reuses it: the
#: router answers 502 and the prefill half of the pair waits out the bootstrap timeout (seen
#: in CI on a request sent after a pause of a few seconds).
SERVER_KEEP_ALIVE_S = 300


@dataclass
class ServerEnv:
    """The environment of every process the harness starts: temporary files in the run's own
    folder and, for servers, the CPU server runtime (its ``sitecustomize`` folder first on
    ``PYTHONPATH``) and PD over loopback TCP."""

    site_folder: Path
    #: ``TMPDIR`` of every process started: SGLang names its ZMQ sockets after temporary files
    #: and keeps its Prometheus folder in one; a killed server leaves them behind.
    temp_folder: Path
    pd: Dict[str, str] = field(default_factory=dict)

    def plain(self) -> Dict[str, str]:
        """This process's environment with temporary files in the run's folder, torch's JIT
        extensions too (built there before the servers start: ``jit_prebuild.py``)."""
        self.temp_folder.mkdir(parents=True, exist_ok=True)
        extensions = self.temp_folder / "torch_extensions"
        return {**os.environ, "TMPDIR": str(self.temp_folder), "TORCH_EXTENSIONS_DIR": str(extensions)}

    def for_tp(self, tp: int, extra: Optional[Dict[str, str]] = None) -> Dict[str, str]:
        env = self.plain()
        paths = [str(self.site_folder)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        env.update(self.pd)
        env.update(
            {
                "PYTHONPATH": os.pathsep.join(paths),
                RUNTIME_ENV: "1",
                "SGLANG_CPU_OMP_THREADS_BIND": omp_binding(tp),
                "PYTHONUNBUFFERED": "1",
                "SGLANG_TIMEOUT_KEEP_ALIVE": str(SERVER_KEEP_ALIVE_S),
            }
        )
        env.update(extra or {})
        return env


def server_argv(model: Path, endpoint: Endpoint, tp: int, args: List[str]) -> List[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--host", endpoint.host, "--port", str(endpoint.port),
        "--model-path", str(model), "--device", "cpu", "--dtype", "bfloat16",
        "--page-size", str(PAGE_SIZE), "--context-length", str(CONTEXT_LENGTH),
        "--tp", str(tp), "--enable-metrics", "--enable-cache-report",
        # idle schedulers busy-poll otherwise: five of them take both cores of the box
        "--sleep-on-idle",
        "--disaggregation-transfer-backend", "mooncake",
        *args,
    ]  # fmt: skip


def prefill_argv(line: LineLaunch, model: Path, endpoint: Endpoint, spec: PrefillSpec) -> List[str]:
    args = [
        *line.model_args(decode=False),
        *line.prefill_cp_args(spec),
        "--disaggregation-mode", "prefill",
        "--disaggregation-bootstrap-port", str(endpoint.bootstrap_port),
        "--max-total-tokens", str(spec.max_total_tokens),
        "--chunked-prefill-size", str(CHUNKED_PREFILL_SIZE),
        "--enable-hierarchical-cache", "--hicache-ratio", str(HICACHE_RATIO),
        "--hicache-mem-layout", spec.mem_layout,
    ]  # fmt: skip
    if spec.storage is not None:
        args += line.storage_args(spec.storage)
    if endpoint.kv_events_port:
        args += ["--kv-events-config", kv_events_config(endpoint)]
    return server_argv(model, endpoint, spec.tp, args + list(spec.extra_args))


def kv_events_config(endpoint: Endpoint) -> str:
    """SGLang's ``KVEventsConfig`` JSON: a ZMQ PUB bound on loopback at the endpoint's port."""
    return json.dumps({"publisher": "zmq", "endpoint": endpoint.kv_events_url, "bind": True})


def decode_argv(line: LineLaunch, model: Path, endpoint: Endpoint, extra_args: Sequence[str] = ()) -> List[str]:
    args = [
        *line.model_args(decode=True),
        "--disaggregation-mode", "decode",
        "--max-total-tokens", str(DECODE_TOKENS),
    ]  # fmt: skip
    return server_argv(model, endpoint, 1, args + list(extra_args))


def router_argv(
    endpoint: Endpoint,
    prometheus_port: int,
    prefills: Sequence[Endpoint],
    decode: Endpoint,
    policy: Optional[str] = None,
    extra_args: Sequence[str] = (),
) -> List[str]:
    """sglang-router in PD mode over ``prefills`` (each a ``--prefill URL BOOTSTRAP_PORT``) and
    one decode; ``policy``: its ``--policy`` (None: the router's default); ``extra_args``
    last (e.g. a fleet router's health-check knobs)."""
    workers = [arg for prefill in prefills for arg in ("--prefill", prefill.url, str(prefill.bootstrap_port))]
    return [
        sys.executable, "-m", "sglang_router.launch_router", "--pd-disaggregation",
        *workers, "--decode", decode.url, *(["--policy", policy] if policy else []),
        "--host", "127.0.0.1", "--port", str(endpoint.port),
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(prometheus_port),
        # workers are checked every second at start (30 s by default), requests bounded
        "--worker-startup-check-interval", "1", "--request-timeout-secs", str(ROUTER_REQUEST_TIMEOUT_S),
        # every answer is the servers' own: a retried request would hide a failed one, and
        # the faults the scenarios plant must not open a circuit for the next scenario
        "--disable-retries", "--disable-circuit-breaker", "--shutdown-grace-period-secs", "1",
        *extra_args,
    ]  # fmt: skip


__all__ = [
    "CHUNKED_PREFILL_SIZE",
    "CONTEXT_LENGTH",
    "Endpoint",
    "L3_PUTS_LOGGED_ENV",
    "LOGICAL_TOKENS",
    "LineLaunch",
    "PAGE_SIZE",
    "PrefillSpec",
    "SERVER_KEEP_ALIVE_S",
    "ServerEnv",
    "StorageSpec",
    "UNSHARDED_CP_L3_WRITERS_ENV",
    "decode_argv",
    "kv_events_config",
    "line_launch",
    "omp_binding",
    "prefill_argv",
    "router_argv",
]
