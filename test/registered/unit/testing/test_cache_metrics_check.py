"""The serving check of upstream's cache series (``testing/server/cache_metrics_check.py``) on
hand-made ``/metrics`` texts and logs: logical series equal per CP rank, physical ones summed,
a series the stretch must move, the hit-rate gauge against the last logged prefill batch.
Runs in both venvs."""

from __future__ import annotations

from types import SimpleNamespace

from sglang_cp_hicache.testing.server.cache_metrics_check import (
    L2_SERIES,
    LOGICAL,
    PHYSICAL,
    Relation,
    compare,
    last_batch_hit_rate,
)
from sglang_cp_hicache.testing.server.metrics import Metrics

TOKENS = Relation("sglang:hicache_backup_tokens_total", LOGICAL, (("pool", "kv"),))
BYTES = Relation("sglang:hicache_backup_bytes_total", PHYSICAL)
L3 = Relation("sglang:backuped_tokens_total", LOGICAL, rank_label="attn_cp_rank")


def _metrics(samples: dict) -> Metrics:
    return Metrics.parse("\n".join(f"{name} {value}" for name, value in samples.items()))


ZERO = _metrics({})


def _sharded(tokens=(640, 640), nbytes=(400, 424), l3=(640, 640)) -> Metrics:
    samples = {}
    for rank in (0, 1):
        samples[f'sglang:hicache_backup_tokens_total{{pool="kv",tp_rank="{rank}"}}'] = tokens[rank]
        samples[f'sglang:hicache_backup_bytes_total{{tp_rank="{rank}"}}'] = nbytes[rank]
        samples[f'sglang:backuped_tokens_total{{attn_cp_rank="{rank}",tp_rank="0"}}'] = l3[rank]
    return _metrics(samples)


def _reference(tokens=640, nbytes=824, l3=640) -> Metrics:
    samples = {}
    for rank in (0, 1):  # each unsharded CP rank holds and moves the whole KV
        samples[f'sglang:hicache_backup_tokens_total{{pool="kv",tp_rank="{rank}"}}'] = tokens
        samples[f'sglang:hicache_backup_bytes_total{{tp_rank="{rank}"}}'] = nbytes
        samples[f'sglang:backuped_tokens_total{{attn_cp_rank="{rank}",tp_rank="0"}}'] = l3
    return _metrics(samples)


def test_logical_series_equal_per_rank_and_physical_ones_summed_pass():
    problems, figures = compare((TOKENS, BYTES, L3), (_sharded(), ZERO), (_reference(), ZERO), cp=2)
    assert problems == []
    assert figures[0] == 'sglang:hicache_backup_tokens_total{pool="kv"} sharded 640/640 ref 640'


def test_a_logical_series_off_on_one_rank_fails_naming_it():
    problems, _ = compare((TOKENS,), (_sharded(tokens=(640, 0)), ZERO), (_reference(), ZERO), cp=2)
    assert len(problems) == 1 and problems[0].startswith('sglang:hicache_backup_tokens_total{pool="kv"} (logical)')


def test_physical_bytes_summed_over_the_ranks_against_one_reference_rank():
    problems, _ = compare((BYTES,), (_sharded(nbytes=(824, 824)), ZERO), (_reference(), ZERO), cp=2)
    assert len(problems) == 1 and "sglang:hicache_backup_bytes_total (physical)" in problems[0]


def test_storage_series_are_read_per_attn_cp_rank():
    problems, _ = compare((L3,), (_sharded(l3=(640, 64)), ZERO), (_reference(), ZERO), cp=2)
    assert len(problems) == 1 and "sglang:backuped_tokens_total (logical)" in problems[0]


def test_deltas_not_totals_and_a_series_that_must_move_did():
    before = _sharded()
    problems, figures = compare((TOKENS,), (_sharded(tokens=(1280, 1280)), before), (_reference(1280), _reference()), cp=2)
    assert problems == [] and figures[0].endswith("sharded 640/640 ref 640")
    problems, _ = compare((TOKENS,), (before, before), (_reference(), _reference()), cp=2)
    assert any("did not move" in p for p in problems)


def test_a_series_missing_on_a_rank_fails():
    one_rank = _metrics({'sglang:hicache_backup_tokens_total{pool="kv",tp_rank="0"}': 640})
    problems, _ = compare((TOKENS,), (one_rank, ZERO), (_reference(), ZERO), cp=2)
    assert any("wanted 2 CP ranks" in p for p in problems)


def test_every_l2_series_of_the_stretch_names_a_relation():
    assert {r.kind for r in L2_SERIES} == {LOGICAL, PHYSICAL}
    assert {r.name for r in L2_SERIES if r.kind == PHYSICAL} == {
        "sglang:hicache_backup_bytes_total",
        "sglang:load_back_bytes_total",
    }


def test_the_hit_rate_of_the_last_prefill_batch_logged_after_the_mark():
    log = "\n".join(
        [
            "[ATTN_CP0 TP0] Prefill batch, #new-seq: 1, #new-token: 40, #cached-token: 0, token usage: 0.02",
            "[ATTN_CP0 TP0] Prefill batch, #new-seq: 1, #new-token: 25, #cached-token: 640, token usage: 0.17",
            "[ATTN_CP0 TP0] Decode batch, something else",
        ]
    )
    server = SimpleNamespace(process=SimpleNamespace(log_text=lambda: log))
    assert last_batch_hit_rate(server, 0) == 640 / 665
    assert last_batch_hit_rate(server, 2) is None
