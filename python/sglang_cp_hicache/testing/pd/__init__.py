"""Multi-process PD disaggregation on loopback, line-agnostic (the rank bodies
live in ``testing/<line>/pd_harness``): ``roles`` (role processes, their environment and
pipes, the bootstrap server), ``cluster`` (a line's cluster run end to end), ``scenario``
(requests, plants, outcomes), ``steps`` (what either line's prefill and decode roles do
around upstream's PD path), ``engine`` (the transfer engine, bytes sent, errors logged).
Import from the module that defines a name."""

from __future__ import annotations

# testing/server/cluster.py imports these two from here (that folder is held by the serving issues).
from sglang_cp_hicache.testing.pd.roles import PDEnv, role_env

__all__ = ["PDEnv", "role_env"]
