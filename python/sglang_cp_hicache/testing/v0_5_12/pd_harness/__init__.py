"""The 0.5.12.post1 line's PD roles: CP prefill ranks and one decode server, real stack end to end.

Each prefill rank (one process, gloo CP group) is the plugin's cache stack (physical NSA pools,
logical owner-lane allocator, CP HiCache; with ``draft``, the MTP draft's pool beside) driven
as SGLang's disaggregated prefill scheduler drives it: upstream's ``PrefillBootstrapQueue``
(its ``MooncakeKVManager`` and ``MooncakeKVSender``), admission (prefix match, host
load-back), chunked forwards through ``alloc_for_extend``, ``send_kv_chunk`` of upstream's
prefill mixin, the CP-all-reduced poll, ``release_kv_cache``. The forward's KV stores are the
deterministic pattern of :mod:`nsa_stack` (owned tokens only, as the shared-KV write path
stores them). The plugin is loaded as SGLang loads it, so its owner filters run inside
upstream's sender.

The decode server (cp 1, one process) holds a full, unsharded pool and runs upstream's
``DecodePreallocQueue`` / ``DecodeTransferQueue`` (``MooncakeKVReceiver``). Its pool starts
filled with a sentinel; after each transfer it checks, byte for byte against the pattern
(the replicated reference: what an unsharded prefill holds), every token's KV, indexer
K/scale and draft KV, the first output token carried as aux data, and at the end that no
page outside the ones it granted changed.

Only the ``Scheduler`` object is a stand-in (it needs a model and a GPU): the dataclasses
below carry exactly the fields upstream's PD queues read. SGLang's parallel-state groups are
stand-ins of the same kind (:class:`GroupShape`): the PD managers read only their sizes and
ranks; the collectives run on the real gloo groups.

Modules: ``scenario`` (the scenario, the planted filter, the pools' buffers), ``context``
(the SGLang stand-ins), ``prefill``, ``decode``.
"""

from __future__ import annotations

from sglang_cp_hicache.testing.pd.cluster import PDLine
from sglang_cp_hicache.testing.pd.scenario import (
    PLANTS,
    DecodeOutcome,
    DecodeReport,
    EvictDevice,
    PDRequest,
    PrefillOutcome,
)
from sglang_cp_hicache.testing.pd.steps import load_plugins
from sglang_cp_hicache.testing.v0_5_12.pd_harness.context import install_parallel_state
from sglang_cp_hicache.testing.v0_5_12.pd_harness.decode import decode_role, DecodeServer
from sglang_cp_hicache.testing.v0_5_12.pd_harness.prefill import prefill_rank_role, PrefillRank
from sglang_cp_hicache.testing.v0_5_12.pd_harness.scenario import (
    PDScenario,
    plant_bug,
    planted_filter,
)

#: This line's roles for the line-agnostic cluster runners of ``testing.pd``
#: (``run_pd_cluster``, ``run_fault_cluster``, ``prefill_startup_failure``).
LINE = PDLine(prefill_role=prefill_rank_role, decode_role=decode_role)

__all__ = [
    "LINE",
    "DecodeOutcome",
    "DecodeReport",
    "EvictDevice",
    "PDRequest",
    "PDScenario",
    "PLANTS",
    "PrefillOutcome",
    "planted_filter",
    "decode_role",
    "prefill_rank_role",
    "DecodeServer",
    "PrefillRank",
    "install_parallel_state",
    "load_plugins",
    "plant_bug",
]
