"""The 0.5.23 line's PD roles for the simulator (``SimConfig.pd``; see ``sim/pd.py``).

Not on this line yet, so ``pd=True`` is refused before any process starts. The line's PD
harness (``testing/v0_5_23/pd_harness.py``) takes the simulator's sharded stack
(``PrefillRank(..., stack=...)``), but its ``PrefillRank.serve`` runs a request's admission
itself (prefix match, ``alloc_extend``, its own KV pattern, insert, release) on that stack:
called from the driver it would change the replayed cache outside the decision log, and the
decode's check reads the harness's pattern (``write_owned_kv``), not the one this line's
forward stores (``sim/v0_5_23/checks.py``). What the roles need, as the 0.5.12.post1 line
has it (``testing/v0_5_12/pd_harness.py``): a send of a request the caller already
prefilled (its ``req_to_token`` row, no cache calls), a decode check of the caller's
pattern, and a decode that releases each request once checked.
"""

from __future__ import annotations

from typing import Optional

from sglang_cp_hicache.sim.pd import LinePD

MISSING = (
    "the SGLang 0.5.23 line has no PD roles in the simulator yet: "
    "testing/v0_5_23/pd_harness.py needs a send of a request the simulator's sharded stack "
    "already prefilled (no admission or insert of its own) and a decode check of the "
    "simulator's KV pattern; run --pd on the 0.5.12.post1 line "
    "(bash scripts/run_sim.sh --sglang 0.5.12.post1 --pd)"
)
PD: Optional[LinePD] = None

__all__ = ["MISSING", "PD"]
