"""SGLang's own servers on this CPU box: a PD cluster (``sglang.launch_server`` prefills and
decode, ``sglang-router``, Mooncake on loopback TCP) serving the tiny GLM-5-shaped DSA model,
the sharded prefill (the plugin's flag, HiCache, L3 where the line admits it) against its
unsharded reference, scenario by scenario (``testing/server/scenarios.py``,
``docs/serving_on_cpu.md``).

The cluster starts once for this module (in both venvs: each line's launch adapter spells its
servers) and every process it started is ended, and checked gone, when the module ends.
Issue 42's short forms run here too, on this cluster: ``flush_after_warm_up``,
``bad_input`` and ``soak_short`` (0.5.23: they need its L3 tier and the flag's refusals)
and ``batch_of_300`` (both lines).
"""

from __future__ import annotations

import json

import pytest

from sglang_cp_hicache.testing.server.launch import line_launch
from sglang_cp_hicache.testing.server.scenarios import scenarios_for
from sglang_cp_hicache.testing.server.session import ServingSession
from sglang_cp_hicache.testing.server.tiny_model import ensure_checkpoint

SCENARIOS = scenarios_for(line_launch())


@pytest.fixture(scope="module")
def session(tmp_path_factory):
    serving = ServingSession.start(tmp_path_factory.mktemp("serving"), ensure_checkpoint())
    yield serving
    serving.close()  # raises naming any process group that outlived SIGKILL
    assert serving.running() == []


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(session, scenario):
    marks = session.cluster.log_marks()
    report = scenario.run(session)
    # Every process's errors during this scenario, routers and decode too: a PD failure shows
    # on the side that gave up, its cause often on the other.
    errors = session.cluster.errors_since(marks)
    assert report.ok, json.dumps(report.as_dict(), indent=1, default=str) + "\n" + "\n".join(errors[-40:])
