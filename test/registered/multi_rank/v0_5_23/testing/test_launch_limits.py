"""The CPU runtime's launch limits (``testing/dist.py``, ``testing/pd/``).

* ``run_ranks``' timeout is a no-progress limit: ranks that report progress
  (``testing.dist.heartbeat``, which the simulator's step loop calls) may run longer than
  it; silent ranks are still stopped at it, named.
* A PD role ends itself when its harness is gone (killed with SIGKILL, so no ``close``):
  a long lifetime leaves no process behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from sglang_cp_hicache.testing.dist import RankContext, RankFailed, heartbeat, run_ranks
from sglang_cp_hicache.testing.pd.roles import RoleChannel, _gone

#: Ranks join their gloo groups inside this limit before their first beat: 2 s was too tight
#: on a loaded 2-core box.
TIMEOUT_S = 4.0
RUN_S = 2 * TIMEOUT_S  # they would report success at RUN_S


def _busy(ctx: RankContext, beat: bool) -> int:
    """Work for RUN_S, beating every quarter of the timeout when asked to."""
    end = time.monotonic() + RUN_S
    while time.monotonic() < end:
        time.sleep(TIMEOUT_S / 4)
        if beat:
            heartbeat()
    return ctx.rank


def test_ranks_that_beat_outlive_the_timeout():
    assert run_ranks(2, _busy, True, timeout_s=TIMEOUT_S) == [0, 1]


def test_silent_ranks_stop_at_the_timeout():
    with pytest.raises(RankFailed, match=rf"no report from ranks \[0, 1\] within {TIMEOUT_S:.0f} s"):
        run_ranks(2, _busy, False, timeout_s=TIMEOUT_S)


def test_a_heartbeat_outside_a_rank_process_does_nothing():
    heartbeat()  # the harness's own process, a PD role: no queue, no error


def sleep_forever(channel: RoleChannel) -> None:
    channel.event("pid", os.getpid())
    time.sleep(3600)


_HARNESS = textwrap.dedent(
    """
    import sys, time
    sys.path.insert(0, {test_dir!r})
    from sglang_cp_hicache.testing.pd.roles import PDCluster
    from test_launch_limits import sleep_forever

    cluster = PDCluster(lifetime_s=3600)
    role = cluster.start("sleeper", sleep_forever)
    print(role.wait_event("pid", 120), flush=True)
    time.sleep(3600)
    """
)


def test_a_pd_role_ends_when_its_harness_is_killed(tmp_path):
    script = _HARNESS.format(test_dir=os.path.dirname(__file__))
    # The killed harness cannot remove its multiprocessing folder: keep it out of /tmp.
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    harness = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=env)
    forkserver = None
    try:
        role_pid = int(harness.stdout.readline())
        assert not _gone(role_pid)
        with open(f"/proc/{role_pid}/stat") as stat:
            forkserver = int(stat.read().rsplit(")", 1)[-1].split()[1])
        harness.send_signal(signal.SIGKILL)
        harness.wait(10)
        deadline = time.monotonic() + 30
        while not _gone(role_pid) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert _gone(role_pid), f"role {role_pid} outlived its killed harness"
    finally:
        harness.kill()
        if forkserver is not None and not _gone(forkserver):
            # SGLang's import leaves threads in the forkserver that keep it from ending
            # with its harness; the test's own process must not leak it.
            os.kill(forkserver, signal.SIGKILL)
