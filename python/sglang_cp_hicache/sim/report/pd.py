"""``SimConfig.pd``: the main column's PD transfers as the decode process checked them
(``PDSummary``), whose problems fail the run."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Sequence

import numpy as np

from sglang_cp_hicache.sim.report.balance import vs_logical
from sglang_cp_hicache.sim.results import PDDecodeStats, RankResult


@dataclass
class PDSummary:
    """``SimConfig.pd``: the main column's finished prefills, sent by its ranks over Mooncake
    to one decode process (a full cp-1 pool) and checked there byte for byte."""

    transferred_requests: int
    transferred_tokens: int
    kv_mismatches: int  # decode-side tokens with wrong target KV / indexer or draft bytes
    draft_kv_mismatches: int  # of those, the MTP draft's
    aux_mismatches: int  # requests whose first token (MTP: hidden state) arrived wrong
    off_grant_pages_changed: int
    decode_leaked_tokens: int
    failed_transfers: int  # failures seen by decode plus those seen by the prefill ranks
    logical_bytes: int  # pages transferred x bytes per logical page (what cp 1 would send)
    sent_bytes_per_rank: List[int]
    sent_bytes_vs_logical: float  # max-rank / (logical / cp)
    transfer_ms: Dict[str, float]  # prefill side: last chunk sent -> CP-wide Success
    decode_transfer_ms: Dict[str, float]  # decode side: preallocated -> transferred
    engine_ms_per_request: float  # the busiest rank's time inside the engine's writes
    # Per rank, pages sent by position-page in the prompt (shared prefixes are the first):
    # where the send balance comes from.
    owned_by_position_per_rank: List[List[int]]
    problems: List[str]


def _ms_stats(seconds: Sequence[float]) -> Dict[str, float]:
    if not seconds:
        return {"p50": 0.0, "p90": 0.0, "mean": 0.0}
    ms = np.array(seconds, dtype=float) * 1000.0
    return {"p50": float(np.percentile(ms, 50)), "p90": float(np.percentile(ms, 90)), "mean": float(ms.mean())}


def pd_summary(results: List[RankResult], decode: PDDecodeStats) -> PDSummary:
    """The decode side's checks and the ranks' send figures; ``problems`` fail the run."""
    ranks = [r.pd for r in results]
    first, c = ranks[0], results[0].counters
    logical = first.pages * first.page_bytes
    sent = [s.sent_bytes for s in ranks]
    failures = decode.failures + [f"rank {r.rank}: {f}" for r, s in zip(results, ranks) for f in s.failures]
    problems = [f"PD transfer failed: {f}" for f in failures[:10]]
    if decode.kv_mismatches or decode.draft_kv_mismatches:
        problems.append(
            f"PD: decode holds wrong bytes for {decode.kv_mismatches} tokens' KV/indexer and "
            f"{decode.draft_kv_mismatches} tokens' draft KV of {decode.tokens} received"
        )
    if decode.aux_mismatches:
        problems.append(f"PD: {decode.aux_mismatches} requests' first token / hidden state arrived wrong")
    if decode.off_grant_pages_changed:
        problems.append(f"PD: {decode.off_grant_pages_changed} decode pages never granted were written")
    if decode.leaked_tokens:
        problems.append(f"PD: {decode.leaked_tokens} decode KV slots not back after the releases")
    finished = c.requests - c.retracted_requests
    counts = {"finished prefills": finished, "decode": decode.requests}
    counts.update({f"rank {r.rank}": s.requests for r, s in zip(results, ranks)})
    if len(set(counts.values())) > 1:
        problems.append(f"PD: transfers do not match the finished prefills: {counts}")
    if not failures and sum(sent) != logical:
        # Every logical page is sent once, by its owner.
        problems.append(f"PD: bytes sent over ranks {sum(sent)} != logical {logical}")
    return PDSummary(
        transferred_requests=decode.requests,
        transferred_tokens=decode.tokens,
        kv_mismatches=decode.kv_mismatches + decode.draft_kv_mismatches,
        draft_kv_mismatches=decode.draft_kv_mismatches,
        aux_mismatches=decode.aux_mismatches,
        off_grant_pages_changed=decode.off_grant_pages_changed,
        decode_leaked_tokens=decode.leaked_tokens,
        failed_transfers=len(failures),
        logical_bytes=logical,
        sent_bytes_per_rank=sent,
        sent_bytes_vs_logical=vs_logical(sent, logical),
        transfer_ms=_ms_stats([t for s in ranks for t in s.transfer_s]),
        decode_transfer_ms=_ms_stats(decode.transfer_s),
        engine_ms_per_request=max(s.engine_s for s in ranks) * 1000.0 / max(1, first.requests),
        owned_by_position_per_rank=[list(s.owned_by_position) for s in ranks],
        problems=problems,
    )
