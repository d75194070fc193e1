"""The L3 series' rank labels under the flag (issue 45's two-node run found them): upstream
labels a rank's storage series with its storage config's ``tp_rank``, which the plugin's
writer rule sets to the attention-TP rank (0 on every CP rank), while the same rank's radix
and scheduler series carry its TP rank; upstream keeps the two alike so one rank's L2 and L3
series line up. Upstream's ``StorageAttachment._resolve_metrics_collector`` as the loaded
plugin leaves it, on CP rank 1 of a tp 2 = cp 2 prefill."""

from __future__ import annotations

import types

import pytest

from sglang_cp_hicache.v0_5_23.storage import owner_io

KEYS = ("storage_backend", "tp_rank", "dp_rank", "pp_rank", "pp_size", "attn_cp_rank", "attn_cp_size")
CP_RANK_1 = types.SimpleNamespace(tp_rank=1, tp_size=2, attn_tp_rank=0, attn_tp_size=1, attn_dp_rank=0, pp_rank=0, pp_size=1)


def _attachment(sharded: bool, built: bool = True) -> types.SimpleNamespace:
    """What ``_resolve_metrics_collector`` reads: the controller's storage config as the writer
    rule made it (``tp_rank`` 0), its CP rank and size, and a collector already built (upstream
    relabels it in place: no second Prometheus registration)."""
    controller = types.SimpleNamespace(
        is_kv_sharded=sharded,
        storage_config=types.SimpleNamespace(tp_rank=0, dp_rank=0, pp_rank=0, pp_size=1),
        get_attn_cp_rank_and_size=lambda: (1, 2),
    )
    collector = types.SimpleNamespace(labels=dict.fromkeys(KEYS)) if built else None
    return types.SimpleNamespace(_cache=types.SimpleNamespace(cache_controller=controller, storage_metrics_collector=collector))


@pytest.fixture
def labels(monkeypatch, plugins_loaded):
    """``labels(sharded)``: the storage collector's labels on CP rank 1, the plugin loaded."""
    import sglang.srt.layers.dp_attention as dp_attention
    import sglang.srt.runtime_context as runtime_context
    from sglang.srt.mem_cache.unified_cache.storage_attachment import StorageAttachment

    monkeypatch.setattr(runtime_context, "get_parallel", lambda: CP_RANK_1)
    monkeypatch.setattr(dp_attention, "is_dp_attention_enabled", lambda: False)
    monkeypatch.setattr(owner_io, "_extension", lambda controller: object() if controller.is_kv_sharded else None)
    return lambda sharded: StorageAttachment._resolve_metrics_collector(_attachment(sharded), "mooncake", None).labels


class _BuiltWith:
    """Stands in for ``StorageMetricsCollector`` (a real one registers process-wide Prometheus
    series, once per process): records the labels it is built with. Upstream's constructor
    creates zero-valued children per ``reason`` from them, so relabelling after the build
    leaves those on ``/metrics`` under the config's ``tp_rank``."""

    built: list = []

    def __init__(self, labels):
        self.labels = labels
        _BuiltWith.built.append(dict(labels))


def test_a_sharded_cp_ranks_collector_is_built_with_its_tp_rank(labels, monkeypatch):
    import sglang.srt.mem_cache.unified_cache.storage_attachment as storage_attachment

    _BuiltWith.built = []
    monkeypatch.setattr(storage_attachment, "resolve_collector_class", lambda role, default: _BuiltWith)
    collector = storage_attachment.StorageAttachment._resolve_metrics_collector(_attachment(True, built=False), "mooncake", None)
    assert [b["tp_rank"] for b in _BuiltWith.built] == [1], _BuiltWith.built
    assert collector.labels["tp_rank"] == 1 and collector.labels["attn_cp_rank"] == 1


def test_a_sharded_cp_ranks_l3_series_carry_its_radix_series_tp_rank(labels):
    from sglang.srt.observability.metrics_collector import radix_cache_metric_labels

    got = labels(True)
    assert got["tp_rank"] == radix_cache_metric_labels("c", CP_RANK_1, False)["tp_rank"] == 1
    assert (got["attn_cp_rank"], got["attn_cp_size"], got["storage_backend"]) == (1, 2, "mooncake")


def test_an_unsharded_controllers_labels_stay_upstreams(labels):
    assert labels(False)["tp_rank"] == 0  # its storage config's, as upstream makes them
