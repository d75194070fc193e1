"""The span a per-layer backup reserves before a forward (``layer_backup.backup_span``):
the leaf the request's insert will create, and how many of its slots the forward stores.

Under EAGLE the radix key is a bigram key, one shorter than the tokens it spans, so a
chunked request's insert after a chunk stops a page short of the chunk's end and the next
chunk's leaf starts at that page, which the earlier forward stored. Seen first through the
servers (the ``eagle_tiers`` scenario): a sharded EAGLE prefill died on the second chunk of
a 1233-token prompt with "layer 0 stored 512 slots while per-layer backups of 576 are held"."""

from __future__ import annotations

import pytest

from sglang_cp_hicache.v0_5_23.backup.layer_backup import backup_span

PAGE = 64


@pytest.mark.parametrize(
    "protected, prefix, extend_end, want",
    [
        (0, 0, 512, (0, 448, 448)),  # first chunk: the key spans 511 tokens, 7 pages
        (448, 512, 1024, (448, 960, 448)),  # page 7 (stored by chunk 1) starts this leaf
        (960, 1024, 1233, (960, 1216, 192)),  # last chunk: fewer new slots than the leaf holds
        (448, 512, 640, (448, 576, 64)),  # 10 pages in 512 + 128
        (384, 384, 430, (384, 384, 0)),  # under a page: nothing
    ],
)
def test_under_bigram_keys_the_leaf_ends_a_token_short_and_may_start_before_the_forward(protected, prefix, extend_end, want):
    start, end, stored_now = backup_span(protected, prefix, extend_end, PAGE, bigram_keys=True)
    assert (start, end, stored_now) == want
    assert stored_now <= extend_end - prefix  # never more than the forward stores


@pytest.mark.parametrize(
    "protected, prefix, extend_end, want",
    [(0, 0, 512, (0, 512, 512)), (512, 512, 1024, (512, 1024, 512)), (1024, 1024, 1233, (1024, 1216, 192))],
)
def test_without_eagle_the_leaf_is_the_forwards_full_pages(protected, prefix, extend_end, want):
    assert backup_span(protected, prefix, extend_end, PAGE, bigram_keys=False) == want
