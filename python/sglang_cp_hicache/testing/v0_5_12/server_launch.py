"""How the serving harness spells SGLang 0.5.12.post1's servers (test-only).

The NSA attention backend with ``flashmla_sparse`` for prefill and decode over bf16 KV; prefill
CP is 0.5.12's ``--enable-nsa-prefill-context-parallel --nsa-prefill-cp-mode
round-robin-split`` (``in-seq-split`` forces DeepEP). The plugin refuses an L3 tier under its
flag on this line, so no storage scenario runs here.

Upstream 0.5.12's unsharded CP prefill sends a request's KV to the decode server through
``page_indices_to_cp_rank_page_indices``, which assumes the request's pages are one
contiguous range: after a prefix hit or in a fragmented pool the decode server receives
wrong pages (reported Success) and decodes other tokens. So the unsharded TP 2 reference
is exact for the first token only (computed on the prefill); the decode tokens are compared
with a one-rank (TP 1, no CP) unsharded prefill's, whose transfer is correct: ids must
match; the logprobs differ by what a TP 1 and a TP 2 forward differ in the KV they write
(reported).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from sglang_cp_hicache.testing.server.launch import PrefillSpec, StorageSpec


@dataclass(frozen=True)
class Launch0512:
    release: str = "0.5.12.post1"
    supports_storage_under_flag: bool = False
    lane_decisions_logged: bool = False
    plugin_metrics: bool = False
    upstream_cache_metrics_compared: bool = False  # 0.5.12's cache series: not checked against the reference
    publishes_kv_events: bool = False
    decode_reference_tp: Optional[int] = 1
    refuses_unservable_requests: bool = False  # upstream's request validation only
    lazy_page_hash_extension: bool = False  # 0.5.12.post1 has no sglang.srt.mem_cache.cpp_utils

    def model_args(self, decode: bool) -> List[str]:
        return ["--attention-backend", "nsa", "--nsa-prefill-backend", "flashmla_sparse",
                "--nsa-decode-backend", "flashmla_sparse"]  # fmt: skip

    def prefill_cp_args(self, spec: PrefillSpec) -> List[str]:
        if spec.cp == 1:
            return []
        args = ["--enable-nsa-prefill-context-parallel", "--nsa-prefill-cp-mode", "round-robin-split"]
        return args + (["--enable-nsa-prefill-cp-shared-kv"] if spec.sharded else [])

    def storage_args(self, storage: StorageSpec) -> List[str]:
        raise ValueError("sglang 0.5.12.post1: the plugin refuses an L3 tier under its flag")


LAUNCH = Launch0512()

__all__ = ["LAUNCH", "Launch0512"]
