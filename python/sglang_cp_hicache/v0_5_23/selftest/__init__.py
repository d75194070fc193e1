"""Self-test room: before a sharded rank serves, the sharded DSA read path against the
replicated one with the resolved backend's kernels (``kv_shard_selftest``, its seeded batch
``kv_shard_selftest_batch``), and the scratch figure upstream charges, logged once
(``kv_shard_scratch``). Exports its hook spec by path only.
"""

from __future__ import annotations

from typing import Tuple

from sglang_cp_hicache.hook_table import HookSpec

HOOKS: Tuple[HookSpec, ...] = (
    # Once the pool, shard group and attention backends exist, before graphs and serving.
    HookSpec(
        "sglang.srt.model_executor.model_runner:ModelRunner.init_attention_backends",
        "sglang_cp_hicache.v0_5_23.selftest.kv_shard_selftest:init_attention_backends_after",
        "AFTER",
    ),
)
