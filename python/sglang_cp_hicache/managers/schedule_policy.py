"""Prefill admission under CP shared KV: no batch reads more KV pages than were reserved.

A shared-KV prefill forward materialises, per layer, every distinct KV page its requests
read into a dense buffer whose size was reserved out of the KV budget at init
(:class:`~sglang_cp_hicache.layers.attention.cp_shared_kv_budget.DenseBufferBudget`).
``PrefillAdder.add_one_req`` (AROUND) keeps the batch inside that reservation:

* a request is admitted only if the batch's pages, counted without sharing
  (:func:`batch_pages_bound`, an upper bound on the distinct pages the forward reads),
  stay within ``budget.max_batch_pages``; otherwise ``AddReqResult.OTHER``: SGLang stops
  filling this batch and the request stays in the waiting queue for a later one;
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
from typing import Any, Callable, Iterable

from sglang_cp_hicache.layers.attention.cp_shared_kv_budget import (
    DenseBufferBudget,
    active_budget,
)
from sglang_cp_hicache.mem_cache.cp_shared_kv_layout import ceil_div

logger = logging.getLogger(__name__)


def request_pages_bound(req: Any, page_size: int) -> int:
    """KV pages ``req`` reads this round, at most: its ``fill_ids`` (prefix + this round's
    input) before any chunk truncation, which can only shorten them."""
    return ceil_div(len(req.fill_ids), page_size)


def batch_pages_bound(reqs: Iterable[Any], page_size: int) -> int:
    """Pages a batch of ``reqs`` reads, counted per request (shared pages counted once per
    request): never below the distinct pages the forward's dense mapping holds."""
    return sum(request_pages_bound(r, page_size) for r in reqs)


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
    reserved at init could not hold; pass everything else to SGLang unchanged."""
    budget = active_budget()
    if budget is None:
        return original(self, req, has_chunked_req, truncation_align_size)
    from sglang.srt.managers.schedule_policy import AddReqResult

    page_size = budget.page_size
    pages = request_pages_bound(req, page_size)
    if pages > budget.max_batch_pages:
        req.set_finish_with_abort(over_budget_message(req, pages, budget))
        req.init_next_round_input(self.tree_cache)  # the one-token input the abort left
    elif batch_pages_bound(self.can_run_list, page_size) + pages > budget.max_batch_pages:
        logger.debug(
            "CP shared KV: request %s (%d pages) waits for a later batch: this one already "
            "reads up to %d of %d pages", req.rid, pages,
            batch_pages_bound(self.can_run_list, page_size), budget.max_batch_pages,
        )
        return AddReqResult.OTHER
    return original(self, req, has_chunked_req, truncation_align_size)
