"""Upstream's D2H backup metrics (``sglang:hicache_backup_*``, filled from ``HiCacheAck`` in
``UnifiedRadixCache._log_write_ack_metrics``) count the plugin's per-layer backups as they
count upstream's own all-layer ones: the REAL 0.5.23 sharded stack (cp 2, gloo ranks, the
plugin's flag, ``--enable-metrics``) beside its unsharded reference, the same two requests
(five pages, and one page a rank owns none of).

* tokens per host pool are logical: each sharded rank counts what the reference counts;
* bytes are physical: each rank counts its own shard, the ranks together the reference's;
* each per-layer batch is one timed backup (one histogram sample per merged write op, as
  upstream's: here the reference's two inserts are one merged op too);
* the plugin's per-layer latency series (``sglang:cp_hicache_layer_backup_*``): one sample
  per batch on each sharded rank, layer 0 on host before the forward's last stores; none
  on the reference (no extension).
"""

from __future__ import annotations

from typing import Dict, List

import pytest

from sglang_cp_hicache.testing.dist import RankContext, run_ranks

PAGE = 64
LAYERS = 2
_A = list(range(1, 5 * PAGE + 1))  # five pages: both ranks own some
_C = list(range(20_001, 20_001 + PAGE))  # one page: one rank owns none of it
PROMPTS = (_A, _C)


def _backup_metrics() -> Dict[str, object]:
    """This process's backup series (one cache per process), read from its registry."""
    from prometheus_client import REGISTRY, generate_latest

    from sglang_cp_hicache.testing.server.metrics import Metrics

    metrics = Metrics.parse(generate_latest(REGISTRY).decode())
    pools = {
        dict(labels)["pool"]: value
        for name, labels, value in metrics.samples
        if name == "sglang:hicache_backup_tokens_total"
    }
    return {
        "tokens_by_pool": pools,
        "bytes": metrics.total("sglang:hicache_backup_bytes_total"),
        "timed_ops": metrics.total("sglang:hicache_backup_duration_seconds_count"),
        "seconds": metrics.total("sglang:hicache_backup_duration_seconds_sum"),
        "first_layer": metrics.total("sglang:cp_hicache_layer_backup_first_layer_seconds_count"),
        "tail": metrics.total("sglang:cp_hicache_layer_backup_tail_seconds_count"),
        "overlapped": metrics.total(
            "sglang:cp_hicache_layer_backup_batches_total", first_layer_on_host="before_forward_end"
        ),
        "batches": metrics.total("sglang:cp_hicache_layer_backup_batches_total"),
    }


def _prefill(stack, per_layer: bool) -> None:
    """Both prompts in one extend batch, inserted, every write acked; ``per_layer``: their
    KV stored layer by layer after the per-layer backup's reservation (as the
    ``Scheduler.run_batch`` hook makes it)."""
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import (
        extend_batch,
        finish_request,
        forward,
        logical_kv,
    )
    from sglang_cp_hicache.v0_5_23.backup.layer_backup import reserve_batch

    batch = extend_batch(stack, PROMPTS)
    if per_layer:  # the reference's all-layer backups copy at the insert, whatever the KV
        assert len(reserve_batch(stack.cache, batch.reqs)) == len(PROMPTS)
        items = []
        for req, prompt in zip(batch.reqs, PROMPTS):
            locs = stack.req_to_token_pool.req_to_token[req.kv.req_pool_idx, : len(prompt)].long()
            items.append((locs, logical_kv(stack, len(prompt), LAYERS, seed=len(prompt))))
        forward(stack, items)
    for req in batch.reqs:
        finish_request(stack.cache, req)
    stack.cache.writing_check(write_back=True)  # every ack popped and counted


def sharded_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import stamp_parallel
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, sharded_stack

    stamp_parallel(ctx.world_size, ctx.rank, ctx.cp_group, ctx.attn_tp_group)  # the collector's rank labels
    config = StackConfig(layer_num=LAYERS, cp_shared_kv=True, enable_metrics=True)
    with sharded_stack(ctx, config) as stack:
        _prefill(stack, per_layer=True)
        return _backup_metrics()


def reference_rank(ctx: RankContext) -> Dict[str, object]:
    from sglang_cp_hicache.testing.v0_5_23.pd_harness.context import stamp_parallel
    from sglang_cp_hicache.testing.v0_5_23.stack import StackConfig, build_unsharded_stack

    stamp_parallel(1, 0, ctx.cp_group, ctx.attn_tp_group)
    config = StackConfig(layer_num=LAYERS, device_pages_per_rank=32, enable_metrics=True)
    with build_unsharded_stack(ctx.attn_tp_group, config) as stack:
        _prefill(stack, per_layer=False)
        return _backup_metrics()


@pytest.fixture(scope="module")
def sharded() -> List[Dict[str, object]]:
    return run_ranks(2, sharded_rank)


@pytest.fixture(scope="module")
def reference() -> Dict[str, object]:
    (report,) = run_ranks(1, reference_rank)
    return report


def test_the_reference_counts_every_new_token_per_pool(reference) -> None:
    tokens = len(_A) + len(_C)
    # the DSA indexer rides the KV slots (a sidecar): upstream counts it in bytes only
    assert reference["tokens_by_pool"] == {"kv": tokens}, reference


def test_each_sharded_rank_counts_the_logical_tokens_the_reference_counts(sharded, reference) -> None:
    for rank, report in enumerate(sharded):  # rank 1 or 0 owns none of C's page: counts it too
        assert report["tokens_by_pool"] == reference["tokens_by_pool"], f"rank {rank}: {report}"


def test_each_rank_counts_its_own_bytes_and_the_ranks_together_the_reference_s(sharded, reference) -> None:
    assert all(report["bytes"] > 0 for report in sharded), sharded
    assert sum(report["bytes"] for report in sharded) == reference["bytes"], (sharded, reference)


def test_each_per_layer_batch_is_one_timed_backup(sharded, reference) -> None:
    assert reference["timed_ops"] == 1  # upstream merges the two inserts' writes
    for rank, report in enumerate(sharded):
        assert report["timed_ops"] == 1, f"rank {rank}: one forward, one ack: {report}"
        assert report["seconds"] > 0, f"rank {rank}: layer 0's stores to the last copy"


def test_each_per_layer_batch_lands_in_the_plugin_s_latency_series(sharded, reference) -> None:
    for rank, report in enumerate(sharded):
        assert report["first_layer"] == report["tail"] == report["batches"] == 1, f"rank {rank}: {report}"
        assert report["overlapped"] == 1, f"rank {rank}: layer 0 was on host before layer 1's stores"
    assert reference["first_layer"] == reference["batches"] == 0, "no plugin series without an extension"
