"""Per-layer CP HiCache backups on N gloo ranks, then load-back: bytes per layer, acks agree.

Each rank backs up only its owned pages, one layer per ``backup_layer`` call (as the NSA
extend hook drives it), alongside an all-layer backup and a node some ranks own nothing
of. Every rank must ack the same node ids in the same order, only after the last layer;
after a device wipe, every loaded page holds what was written, layer by layer.
"""

import pytest

from sglang_cp_hicache.testing.dist import run_ranks
from sglang_cp_hicache.testing.v0_5_12.per_layer_round_trip import (
    per_layer_round_trip,
    round_trip_problems,
)


@pytest.mark.parametrize("cp_size", [2, 3])
@pytest.mark.parametrize("io_backend,layout", [("direct", "layer_first"), ("kernel", "layer_first"), ("direct", "page_first_direct")])
def test_per_layer_backups_load_back_byte_exact_with_identical_acks(cp_size, io_backend, layout):
    results = run_ranks(cp_size, per_layer_round_trip, io_backend, layout)
    assert round_trip_problems(results) == []
    assert [result["overlap_ms"] for result in results] == [None] * cp_size  # CPU: no timing


def test_the_contract_check_names_what_broke():
    """``round_trip_problems`` (also the device check's verdict) catches each breach."""
    good = {"acks_before_last": [[13]], "acks": [[13], [11, 12]],
            "loaded": {11: [0, 0, 0, 64], 12: [0, 0, 0, 0], 13: [0, 0, 0, 64]}}
    last = dict(good, loaded={11: [0, 0, 0, 64], 12: [0, 0, 0, 128], 13: [0, 0, 0, 128]})
    assert round_trip_problems([good, last]) == []
    early = dict(good, acks_before_last=[[13], [11, 12]])
    stale = dict(last, loaded={**last["loaded"], 11: [0, 0, 64, 64]})  # layer 2 copied before stored
    assert round_trip_problems([early, stale]) == [
        "rank 0: acks before the last layer [[13], [11, 12]]",
        "rank 1 node 11: mismatched tokens per layer [0, 0, 64]",
    ]
    assert round_trip_problems([last, good]) == ["node 12 owned by ranks [0], expected [1]"]
