"""The simulator's ``--pd`` on the 0.5.23 line: refused before any process starts, with one
message naming what is missing (the line's PD harness has no "send a request an existing
sharded rank stack prefilled" entry yet), and pointing at the line that runs it. The
0.5.12.post1 twin, ``multi_rank/v0_5_12/test_simulator_pd.py``, runs the transfers."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.sim import SimConfig, run_simulation
from sglang_cp_hicache.sim.cli import main


def test_pd_is_refused_naming_what_is_missing(capsys) -> None:
    with pytest.raises(ValueError, match="testing/v0_5_23/pd_harness.py"):
        run_simulation(SimConfig(pd=True, num_requests=2, baseline=False))
    with pytest.raises(SystemExit) as exit_info:  # usage error: exit code 2, nothing ran
        main(["--pd", "--num-requests", "2", "--no-progress"])
    assert exit_info.value.code == 2
    assert "0.5.12.post1" in capsys.readouterr().err
