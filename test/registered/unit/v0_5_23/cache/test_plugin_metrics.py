"""The plugin's series object (``v0_5_23.cache.plugin_metrics``) on its own registry: the
L3 backends' own counts reach their counters (the real owner-free file backend; the
Mooncake store's counts through its ``MasterOutage``), a new backend counts from zero,
and a per-layer batch's timeline lands in its histograms. The series moving in the real
stack: ``multi_rank/v0_5_23/cache/test_plugin_metrics_multi_rank.py``."""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.core.per_layer_backup import BatchTimeline
from sglang_cp_hicache.testing.device import CpuDeviceModule
from sglang_cp_hicache.testing.server.metrics import Metrics

LABELS = {"cache_type": "UnifiedRadixCache", "tp_rank": 1, "pp_rank": 0, "dp_rank": 0, "attn_cp_rank": 1}


@pytest.fixture
def series():
    from prometheus_client import CollectorRegistry, generate_latest

    from sglang_cp_hicache.v0_5_23.cache.plugin_metrics import CpCacheMetrics

    registry = CollectorRegistry()
    metrics = CpCacheMetrics(LABELS, page_size=64, registry=registry)
    return metrics, lambda: Metrics.parse(generate_latest(registry).decode())


@pytest.fixture
def file_backend(tmp_path):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    from sglang_cp_hicache.core.storage_keys import StorageNamespace
    from sglang_cp_hicache.v0_5_23.storage.file_backend import OwnerFreeHiCacheFile

    def build():
        config = HiCacheStorageConfig(
            tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=2,
            is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
            model_name="m", extra_config={"file_storage_path": str(tmp_path)},
        )  # fmt: skip
        namespace = StorageNamespace(model="m", kv_dtype="torch.bfloat16", kv_cache_dim=576,
                                     layer_num=2, host_layout="layer_first", page_size=64)  # fmt: skip
        return OwnerFreeHiCacheFile(config, namespace)

    return build


def _torn_read(backend) -> None:
    backend.set("abc", torch.full((32,), 7, dtype=torch.bfloat16))  # half a page
    assert backend.get("abc", torch.zeros(64, dtype=torch.bfloat16)) is None


def test_a_rejected_file_read_moves_its_counter_once(series, file_backend) -> None:
    metrics, scrape = series
    backend = file_backend()
    metrics.sync_l3(backend)
    assert scrape().total("sglang:cp_hicache_l3_rejected_reads_total") == 0
    _torn_read(backend)
    metrics.sync_l3(backend)
    metrics.sync_l3(backend)  # a tick with nothing new adds nothing
    samples = scrape()
    assert samples.total("sglang:cp_hicache_l3_rejected_reads_total") == 1
    (labels,) = [dict(l) for n, l, _ in samples.samples if n == "sglang:cp_hicache_l3_rejected_reads_total"]
    assert labels["tp_rank"] == "1" and labels["attn_cp_rank"] == "1"


def test_a_backend_attached_anew_counts_from_zero(series, file_backend) -> None:
    metrics, scrape = series
    first = file_backend()
    _torn_read(first)
    _torn_read(first)
    metrics.sync_l3(first)
    second = file_backend()  # detach, attach: a new backend, its counts from 0
    _torn_read(second)
    metrics.sync_l3(second)
    assert scrape().total("sglang:cp_hicache_l3_rejected_reads_total") == 3


def test_master_outages_reconnects_and_failed_batches_reach_their_counters(series, monkeypatch) -> None:
    import socket

    from sglang_cp_hicache.v0_5_23.storage import mooncake_backend as ours

    metrics, scrape = series
    monkeypatch.setattr(ours, "OUTAGE_RECHECK_S", 0.0)
    store = object.__new__(ours.OwnerFreeMooncakeStore)  # its counts live in its outage
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        store.outage = ours.MasterOutage("127.0.0.1:%d" % listener.getsockname()[1])
        store.outage.call("batch put", 2, lambda: [ours.RPC_FAIL] * 2)  # the master is gone
        metrics.sync_l3(store)
        assert store.outage.call("batch get", 1, lambda: [64]) == [64]  # and back
    metrics.sync_l3(store)
    samples = scrape()
    assert samples.total("sglang:cp_hicache_l3_master_outages_total") == 1
    assert samples.total("sglang:cp_hicache_l3_master_reconnects_total") == 1
    assert samples.total("sglang:cp_hicache_l3_failed_batches_total", by="client") == 1
    assert samples.total("sglang:cp_hicache_l3_failed_batches_total", by="outage") == 0


def _timeline(module, order):
    events = {name: module.Event(enable_timing=True) for name in order}
    for name in order:  # recorded in this order
        events[name].record()
    return BatchTimeline(**events)


def test_a_per_layer_batch_lands_in_the_latency_series(series) -> None:
    metrics, scrape = series
    module = CpuDeviceModule()
    metrics.observe_layer_backup(_timeline(module, ["first_stored", "first_on_host", "last_stored", "finished"]))
    metrics.observe_layer_backup(_timeline(module, ["first_stored", "last_stored", "first_on_host", "finished"]))
    samples = scrape()
    assert samples.total("sglang:cp_hicache_layer_backup_first_layer_seconds_count") == 2
    assert samples.total("sglang:cp_hicache_layer_backup_tail_seconds_count") == 2
    batches = "sglang:cp_hicache_layer_backup_batches_total"
    assert samples.total(batches, first_layer_on_host="before_forward_end") == 1
    assert samples.total(batches, first_layer_on_host="after_forward_end") == 1
