"""``serve_cpu.sh --keep`` without a server (``testing/server/keep.py``): the signals that end
it, the URLs it writes and prints. The kept cluster itself: ``test/registered/serving/v0_5_23/test_keep.py``.
Runs in both venvs."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

from sglang_cp_hicache.testing.server.cluster import Router, Server
from sglang_cp_hicache.testing.server.keep import StopServing, cluster_urls, stop_on_signals, usage
from sglang_cp_hicache.testing.server.launch import Endpoint
from sglang_cp_hicache.testing.server.processes import ManagedProcess
from sglang_cp_hicache.testing.server.session import ServingSession


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_first_signal_stops_later_ones_cannot_cut_the_clean_up_short(sig):
    before = signal.getsignal(sig)
    cleaned = []
    with pytest.raises(StopServing, match=signal.Signals(sig).name):
        with stop_on_signals():
            try:
                os.kill(os.getpid(), sig)  # the handler runs right after, in this thread
                cleaned.append(False)  # never reached
            finally:
                os.kill(os.getpid(), sig)  # a second Ctrl-C during the clean-up: ignored
                cleaned.append(True)
    assert cleaned == [True]
    assert signal.getsignal(sig) == before


def _server(name: str, port: int) -> Server:
    process = ManagedProcess(name, [sys.executable], {}, Path("/nonexistent.log"), lambda: True, 1.0)
    return Server(name, Endpoint(port, port + 1), process)


def _session() -> ServingSession:
    decode, sharded, reference = _server("decode", 20001), _server("sharded", 20003), _server("reference", 20005)
    routers = [
        Router(f"router-{p.name}", Endpoint(port), ManagedProcess("r", [], {}, Path("/x"), lambda: True, 1.0), p, decode, port + 1)
        for p, port in ((sharded, 20011), (reference, 20021))
    ]  # fmt: skip
    return ServingSession(None, 2, None, decode, sharded, reference, *routers)


def test_urls_name_the_sharded_and_reference_routers_and_servers():
    urls = cluster_urls(_session(), Path("/models/tiny"))
    assert urls == {
        "routers": {"sharded": "http://127.0.0.1:20011", "reference": "http://127.0.0.1:20021"},
        "servers": {"sharded": "http://127.0.0.1:20003", "reference": "http://127.0.0.1:20005", "decode": "http://127.0.0.1:20001"},
        "model": "/models/tiny",
    }


def test_usage_shows_a_curl_example_and_every_metrics_url():
    session = _session()
    text = usage(session, cluster_urls(session, Path("/models/tiny")))
    assert "curl -s http://127.0.0.1:20011/generate" in text
    for url in ("http://127.0.0.1:20003/metrics", "http://127.0.0.1:20001/metrics", "http://127.0.0.1:20012/metrics"):
        assert url in text
