"""Prefill admission (``PrefillAdder.add_one_req``, AROUND): split deferral and the dense-buffer
budget.

**Split deferral (CP HiCache).** A request whose prefix match stopped above a node it would
have split, because that node's host backup is pending (not host-visible until its final
ack), is not added to this prefill batch: it stays in the waiting queue, holding no lock, and
is matched again next round, after that round's write acks (``check_hicache_events`` starts
each round). Other requests, and the pending backup itself, are untouched; the transfer is
never drained. Only the plugin's CP-mode cache defers (:func:`cp_hicache_of`, by type, the
cache inside SGLang's ``StreamingSession`` included); any other cache, a ``MagicMock`` of
upstream's tests among them, is upstream's path.

**Budget (CP shared KV): no batch reads more KV pages than were reserved.**

A shared-KV prefill forward materialises, per layer, every distinct KV page its requests
read into a dense buffer whose size was reserved out of the KV budget at init
(:class:`~sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget.DenseBufferBudget`).
``PrefillAdder.add_one_req`` (AROUND) keeps the batch inside that reservation:

* a request is admitted only if the batch's pages, counted per request
  (:func:`batch_pages_bound`, an upper bound on the distinct pages the forward reads) plus
  the most the request can read this round (:func:`candidate_pages_bound`), stay within
  ``budget.max_batch_pages``; otherwise ``AddReqResult.OTHER``: SGLang stops filling this
  batch and the request stays in the waiting queue for a later one;
* a request that alone exceeds the reservation is aborted at admission the way SGLang
  aborts invalid input (``Req.set_finish_with_abort``: a one-token prefill that returns
  the error). With the reservation sized to the context length this cannot happen: SGLang
  refuses inputs of ``max_req_input_len < context_len`` tokens or more before admission;
  it guards a smaller reservation.

Every CP rank runs the same scheduler on the same requests and the budget derives from
the replicated model config, so every rank takes the same decision with no collective.
The chunked request that ``add_chunked_req`` re-adds first is alone in the batch then, so
it always fits.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional

from sglang_cp_hicache.v0_5_12.layers.attention.cp_shared_kv_budget import (
    DenseBufferBudget,
    active_budget,
)
from sglang_cp_hicache.core.cp_shared_kv_layout import ceil_div
from sglang_cp_hicache.v0_5_12.own_objects import cp_hicache_of

logger = logging.getLogger(__name__)


def request_pages(req: Any, page_size: int) -> int:
    """KV pages of ``req``'s ``fill_ids`` (prefix + input): what an admitted request reads
    this round (``add_one_req``/``add_chunked_req`` cut ``fill_ids`` to the chunk)."""
    return ceil_div(len(req.fill_ids), page_size)


def candidate_pages_bound(req: Any, page_size: int, rem_chunk_tokens: Optional[int]) -> int:
    """The most pages ``req`` can read this round if ``add_one_req`` admits it.

    Without chunked prefill: all of ``fill_ids``. With it, ``add_one_req`` cuts the input
    to at most ``rem_chunk_tokens`` after the prefix, which a host hit may lengthen by
    ``host_hit_length`` (a refused load-back only shortens it).
    """
    tokens = len(req.fill_ids)
    if rem_chunk_tokens is not None:
        prefix = len(req.prefix_indices) + req.host_hit_length
        tokens = min(tokens, prefix + max(rem_chunk_tokens, 0))
    return ceil_div(tokens, page_size)


def batch_pages_bound(reqs: Iterable[Any], page_size: int) -> int:
    """Pages a batch of admitted ``reqs`` reads, counted per request (shared pages once per
    request): never below the distinct pages the forward's dense mapping holds."""
    return sum(request_pages(r, page_size) for r in reqs)


def over_budget_message(req: Any, pages: int, budget: DenseBufferBudget) -> str:
    return (
        f"--enable-nsa-prefill-cp-shared-kv: request {req.rid} reads {pages} KV pages "
        f"({len(req.fill_ids)} tokens), more than the {budget.max_batch_pages} pages "
        f"({budget.max_prefix_tokens} tokens) the dense buffers were reserved for at init"
    )


def add_one_req_around(
    original: Callable, self: Any, req: Any, has_chunked_req: bool, truncation_align_size: Any
) -> Any:
    """AROUND ``PrefillAdder.add_one_req``: defer or abort a request the dense buffers
    reserved at init could not hold, keep waiting one that would split a pending backup;
    pass everything else to SGLang unchanged."""
    from sglang.srt.managers.schedule_policy import AddReqResult

    cp_cache = cp_hicache_of(self.tree_cache)
    if cp_cache is not None and cp_cache.take_split_deferral(req):
        return AddReqResult.CONTINUE  # not in can_run_list: the scheduler keeps it waiting
    budget = active_budget()  # reserved at init only with the flag on
    if budget is None:
        return original(self, req, has_chunked_req, truncation_align_size)

    page_size = budget.page_size
    total_pages = request_pages(req, page_size)
    if total_pages > budget.max_batch_pages:  # its last round could never run
        req.set_finish_with_abort(over_budget_message(req, total_pages, budget))
        req.init_next_round_input(self.tree_cache)  # the one-token input the abort left
        return original(self, req, has_chunked_req, truncation_align_size)
    batch_pages = batch_pages_bound(self.can_run_list, page_size)
    pages = candidate_pages_bound(req, page_size, self.rem_chunk_tokens)
    if batch_pages + pages > budget.max_batch_pages:
        logger.debug(
            "CP shared KV: request %s (up to %d pages) waits for a later batch: this one "
            "already reads up to %d of %d pages", req.rid, pages, batch_pages, budget.max_batch_pages,
        )
        return AddReqResult.OTHER
    return original(self, req, has_chunked_req, truncation_align_size)
