"""``serve_cpu.sh --keep``: the main PD cluster kept up for one's own requests.

Starts the session's cluster (:class:`ServingSession`), prints the routers' and servers' URLs,
a ``curl`` example and the ``/metrics`` URLs, writes them as JSON (``{"routers": {name: url},
"servers": {name: url}, "model": path}``) where asked, and serves until SIGINT or SIGTERM
(or until one of its processes dies); then it ends every process it started, each by its
group, checks that none is left and removes the URLs file (it names a cluster that is gone).
A signal during the start ends what was started.
"""

from __future__ import annotations

import json
import signal
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Dict, Iterator, Optional

from sglang_cp_hicache.testing.server.session import REFERENCE, SHARDED, ServingSession

POLL_S = 1.0
CURL_BODY = {"text": "the quick brown fox", "sampling_params": {"max_new_tokens": 8, "temperature": 0}}


class StopServing(BaseException):
    """SIGINT or SIGTERM arrived (a BaseException, as KeyboardInterrupt: nothing catches it
    on the way out but the cluster's own clean-up)."""


@contextmanager
def stop_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise :class:`StopServing` once; later ones are ignored, so a second
    Ctrl-C cannot cut the clean-up short. The previous handlers come back on exit."""
    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    stopping = []

    def handler(signum: int, _frame) -> None:
        if stopping:
            return
        stopping.append(signum)
        raise StopServing(signal.Signals(signum).name)

    for sig in previous:
        signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def cluster_urls(session: ServingSession, model: Path) -> Dict[str, object]:
    """The routers' and servers' URLs by name (``sharded``, ``reference``, ``decode``, and
    the decode reference on a line that has one) and the model folder."""
    routers = {SHARDED: session.sharded_router, REFERENCE: session.reference_router}
    servers = {SHARDED: session.sharded, REFERENCE: session.reference, "decode": session.decode}
    if session.decode_reference is not None:
        routers[session.decode_reference.name] = session.decode_reference_router
        servers[session.decode_reference.name] = session.decode_reference
    return {
        "routers": {name: router.url for name, router in routers.items()},
        "servers": {name: server.url for name, server in servers.items()},
        "model": str(model),
    }


def usage(session: ServingSession, urls: Dict[str, object]) -> str:
    """What ``--keep`` prints: where to send requests, a ``curl`` example, the metrics."""
    lines = ["routers (send requests here; each router = its prefill + the shared decode):"]
    lines += [f"  {name:<18} {url}" for name, url in urls["routers"].items()]
    lines.append("servers:")
    lines += [f"  {name:<18} {url}" for name, url in urls["servers"].items()]
    example = urls["routers"][SHARDED]
    lines.append("try (the reference answers the same; add \"stream\": true for a stream):")
    lines.append(f"  curl -s {example}/generate -H 'Content-Type: application/json' -d '{json.dumps(CURL_BODY)}'")
    lines.append("metrics (Prometheus text; cached tokens by tier: sglang:cached_tokens_total):")
    lines += [f"  {name:<18} {url}/metrics" for name, url in urls["servers"].items()]
    routers = [session.sharded_router, session.reference_router]
    lines += [f"  router-{r.prefill.name:<11} {r.metrics_url}" for r in routers]
    lines.append(f"model (tokenizer too): {urls['model']}")
    return "\n".join(lines)


def serve_until_stopped(session: ServingSession, poll_s: float = POLL_S) -> Optional[str]:
    """Block until a signal (raised as :class:`StopServing`) or a process of the session
    dies; the name of a dead process, or None."""
    while True:
        processes = session.cluster.processes
        dead = [name for name, process in processes.items() if not process.running()]
        if dead:
            return ", ".join(dead)
        time.sleep(poll_s)


def keep(run_dir: Path, model: Path, tp: int, urls_file: Optional[Path]) -> int:
    """Start the cluster, print and write where it serves, serve until stopped, end every
    process; 0 when stopped by a signal and nothing is left, 1 otherwise."""
    session: Optional[ServingSession] = None
    dead: Optional[str] = None
    with stop_on_signals():
        try:
            session = ServingSession.start(run_dir, model, tp=tp)
            urls = cluster_urls(session, model)
            if urls_file is not None:
                urls_file.write_text(json.dumps(urls, indent=1))
            print(usage(session, urls), flush=True)
            print(f"serving; Ctrl-C or SIGTERM ends every process (logs in {run_dir / 'logs'})", flush=True)
            dead = serve_until_stopped(session)
            print(f"FAIL {dead} ended on its own; ending the rest", flush=True)
        except StopServing as stop:
            print(f"{stop}: ending every process", flush=True)
        finally:
            if urls_file is not None:
                urls_file.unlink(missing_ok=True)
            if session is not None:
                session.close()  # raises ProcessLeak naming a group that outlived SIGKILL
    left = session.running() if session is not None else []
    if left:
        print(f"FAIL still running: {left}", flush=True)
    else:
        print("every process ended", flush=True)
    return 1 if dead or left else 0


__all__ = ["StopServing", "cluster_urls", "keep", "serve_until_stopped", "stop_on_signals", "usage"]
