"""How the serving harness spells SGLang 0.5.23's servers (test-only).

The DSA attention backend with upstream's torch top-k; prefill ``flashmla_sparse`` over bf16
KV (the H200 default the plugin admits under its flag); a decode server reads with
``flashmla_sparse`` too (its ``fa3`` default has no CPU stand-in; a sharded prefill never
decodes, and the plugin admits only ``fa3`` beside ``flashmla_sparse`` there). Prefill CP is
0.5.23's ``--enable-prefill-cp --cp-strategy interleave``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import List, Optional

from sglang_cp_hicache.testing.server.launch import PrefillSpec, StorageSpec

MOONCAKE_SEGMENT_BYTES = 64 << 20  # per client; the 4 GB default is too much for the box


@dataclass(frozen=True)
class Launch0523:
    release: str = "0.5.23"
    supports_storage_under_flag: bool = True
    lane_decisions_logged: bool = True  # the CPU server runtime logs the lane planner's plans
    plugin_metrics: bool = True  # the cache room's sglang:cp_hicache_* series (--enable-metrics)
    upstream_cache_metrics_compared: bool = True  # testing/server/cache_metrics_check.py
    publishes_kv_events: bool = True
    decode_reference_tp: Optional[int] = None  # the unsharded reference is exact for every token
    refuses_unservable_requests: bool = True  # the admission room's refusals under the flag
    lazy_page_hash_extension: bool = True  # cpp_utils.native_hash, built at the first L3 query

    def model_args(self, decode: bool) -> List[str]:
        args = ["--attention-backend", "dsa", "--dsa-topk-backend", "torch",
                "--dsa-prefill-backend", "flashmla_sparse"]  # fmt: skip
        if decode:
            args += ["--dsa-decode-backend", "flashmla_sparse"]
        return args

    def eagle_args(self) -> List[str]:
        """EAGLE with the checkpoint's NextN layer as the draft: a chain of one draft token.
        The draft worker reads its own top-k backend flag (``DSATopKBackend.resolve``: the
        default ``sgl-kernel`` builds a JIT CUDA plan), so it names upstream's torch one too."""
        return ["--speculative-algorithm", "EAGLE", "--speculative-eagle-topk", "1",
                "--speculative-num-steps", "1", "--speculative-num-draft-tokens", "2",
                "--speculative-dsa-topk-backend", "torch"]  # fmt: skip

    def prefill_cp_args(self, spec: PrefillSpec) -> List[str]:
        # The flag needs prefill CP even on one rank (its one-rank L3 mode, CP size 1).
        if spec.cp == 1 and not spec.sharded:
            return []
        args = ["--enable-prefill-cp", "--cp-strategy", "interleave"]
        return args + (["--enable-nsa-prefill-cp-shared-kv"] if spec.sharded else [])

    def storage_args(self, storage: StorageSpec) -> List[str]:
        args = ["--hicache-storage-backend", storage.backend,
                # every hit waits for its whole prefetch: hit lengths are deterministic
                "--hicache-storage-prefetch-policy", "wait_complete"]  # fmt: skip
        if storage.backend == "mooncake":
            segment = storage.mooncake_segment_bytes
            config = {
                "master_server_address": storage.mooncake_master,
                "protocol": "tcp",
                "metadata_server": "P2PHANDSHAKE",
                "local_hostname": "127.0.0.1",
                "global_segment_size": MOONCAKE_SEGMENT_BYTES if segment is None else segment,
            }
            args += ["--hicache-storage-backend-extra-config", json.dumps(config)]
        return args


LAUNCH = Launch0523()

__all__ = ["LAUNCH", "Launch0523"]
