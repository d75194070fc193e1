"""``serve_cpu --keep --urls-file F`` as a user runs it: the CPU PD cluster comes up, F names the
routers and servers (``sharded`` and ``reference`` among them) and the model, a request goes
through both routers from F, and SIGTERM ends it: its own process group and every process the
cluster started are gone within bounds (``testing/server/keep.py``).

One line's venv (0.5.23) is enough: ``--keep`` is line-agnostic and the other line's cluster
starts the same way. Starts a cluster of its own (about 2 minutes on 2 cores).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import List

import psutil

from sglang_cp_hicache.testing.server.client import generate
from sglang_cp_hicache.testing.server.processes import http_status

START_WITHIN_S = 600.0  # the cluster's own bounds: servers 420 s, routers 120 s
END_WITHIN_S = 150.0  # SIGTERM, 15 s grace per group (one after another), SIGKILL, checked gone


def _started_by(run_dir: Path) -> List[psutil.Process]:
    """Live processes whose temporary folder is ``run_dir``'s: every process the cluster
    started and every child they spawned (the harness gives each ``TMPDIR=<run>/tmp``)."""
    marker = str(run_dir / "tmp")
    found = []
    for process in psutil.process_iter():
        try:
            if process.environ().get("TMPDIR") == marker and process.status() != psutil.STATUS_ZOMBIE:
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def _wait_for(path: Path, keep: subprocess.Popen, log: Path) -> dict:
    deadline = time.monotonic() + START_WITHIN_S
    while time.monotonic() < deadline:
        assert keep.poll() is None, f"--keep exited with {keep.returncode}:\n{log.read_text()[-3000:]}"
        if path.exists() and path.stat().st_size > 0:
            return json.loads(path.read_text())
        time.sleep(1.0)
    raise AssertionError(f"no URLs file after {START_WITHIN_S:.0f} s:\n{log.read_text()[-3000:]}")


def test_keep_serves_through_both_routers_then_sigterm_ends_every_process(tmp_path):
    run_dir, urls_file, log = tmp_path / "run", tmp_path / "urls.json", tmp_path / "keep.log"
    argv = [sys.executable, "-m", "sglang_cp_hicache.testing.server", "--keep", "--urls-file", str(urls_file), "--run-dir", str(run_dir)]
    with open(log, "wb") as out:
        keep = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        urls = _wait_for(urls_file, keep, log)
        assert {"sharded", "reference"} <= set(urls["routers"]) and {"sharded", "reference", "decode"} <= set(urls["servers"])
        assert Path(urls["model"], "config.json").exists()
        answers = {name: generate(url, list(range(3, 3 + 100)), 4) for name, url in urls["routers"].items()}
        assert answers["sharded"].output_ids == answers["reference"].output_ids and len(answers["sharded"].output_ids) == 4
        printed = log.read_text()
        assert "curl -s " + urls["routers"]["sharded"] + "/generate" in printed and urls["servers"]["sharded"] + "/metrics" in printed
        started = _started_by(run_dir)
        assert len(started) >= 5, [p.name() for p in started]  # servers, routers and their children
        os.kill(keep.pid, signal.SIGTERM)
        keep.wait(timeout=END_WITHIN_S)
    finally:
        if keep.poll() is None:
            os.killpg(keep.pid, signal.SIGKILL)
            keep.wait()
    assert keep.returncode == 0, log.read_text()[-3000:]
    assert "every process ended" in log.read_text()
    try:
        os.killpg(keep.pid, 0)
        raise AssertionError(f"--keep's process group {keep.pid} outlived it")
    except ProcessLookupError:
        pass
    assert _started_by(run_dir) == []
    assert all(http_status(f"{url}/health", timeout_s=1.0) is None for url in urls["servers"].values())
    assert not urls_file.exists()  # it named a cluster that is gone
