"""Requests a server under ``--enable-nsa-prefill-cp-shared-kv`` refuses (HTTP 400) that
upstream 0.5.23 admits, found through SGLang's own PD cluster (``docs/refusals.md``):

* a token id outside ``[0, vocab_size)``: upstream serves it, on TP > 1 with a zero
  embedding (``VocabParallelEmbedding`` masks ids outside each rank's shard: a silently
  wrong answer), and on one rank the embedding lookup indexes out of range (a device-side
  fault on a GPU);
* ``return_logprob`` with ``top_logprobs_num`` above the vocabulary: ``logprobs.topk`` raises
  in the sampler (``layers/logprob_processor.py``, ``get_top_logprobs_raw``) and the
  scheduler process dies, taking the server with it;
* ``return_logprob`` with ``logprob_start_len`` below -1: upstream slices the prompt with it
  as a negative index and the prefill's scheduler dies on an assertion
  (``logprob_result_processor.add_input_logprob_return_values``);
* ``text`` and ``input_ids`` together: upstream serves ``input_ids`` and drops the text
  without a word.

The checks run AROUND ``TokenizerManager._validate_one_request``, after upstream's own, on
two kinds of server, decided once, when the manager is built
(:func:`tokenizer_manager_init_after`); per request the hook asks only whether the manager
has limits:

* a server under the flag (any mode but off);
* a PD decode server (``--disaggregation-mode decode``), which runs without the flag.
  sglang-router (0.3.2, the pinned one) sends each request to the prefill and the decode
  at once, waits for both, and answers with the decode's status when the decode fails: a
  request only the flag's prefill refuses is admitted by the decode, which waits for KV
  that never comes until its PD wait ends with HTTP 500. Refusing the same requests on the
  decode makes the client's answer the 400 and its message, at once, with any router
  (newer gateways forward the prefill's 4xx themselves). The decode has a reason of its
  own for one of them: its sampler takes the output tokens' top logprobs with the same
  ``get_top_logprobs_raw``. A decode paired with an unsharded prefill refuses them as
  well: that prefill, upstream's, admits the request and frees its room only at its PD
  bootstrap wait, and the router answers with the decode's 400 then (no forward runs, so
  upstream's prefill no longer dies on the two that killed it).

Any other server (a prefill without the flag, a server without PD): upstream's validation,
unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

#: ``logprob_start_len``'s default: no prompt logprobs.
NO_PROMPT_LOGPROBS = -1
#: ``--disaggregation-mode`` of a PD decode server.
DECODE_MODE = "decode"
#: Why a server refuses, appended to each refusal: under the flag, or the PD decode.
UNDER_FLAG = f"refused under {CLI_FLAG}"
ON_PD_DECODE = f"refused by the PD decode as by its {CLI_FLAG} prefills: the router answers with the decode's response"


@dataclass(frozen=True)
class RequestLimits:
    """What one request must satisfy beyond upstream's checks; ``vocab_size`` is the
    model's (token ids index its embedding and logits); ``refused_by`` says why this
    server refuses (:data:`UNDER_FLAG` or :data:`ON_PD_DECODE`)."""

    vocab_size: int
    refused_by: str

    def problem(
        self,
        input_ids: Optional[Sequence[int]],
        *,
        text_and_ids: bool = False,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = NO_PROMPT_LOGPROBS,
    ) -> Optional[str]:
        """Why the request is refused, or None when it may be served. ``input_ids``: what
        would be served (given, or the text's tokens); ``text_and_ids``: both were sent."""
        if text_and_ids:
            return "text and input_ids are both given: send one of them"
        bad = self._outside_vocabulary(input_ids or ())
        if bad is not None:
            position, token = bad
            return (
                f"input_ids[{position}] = {token} is outside the vocabulary [0, {self.vocab_size}): "
                "such an id cannot be served (an out-of-range embedding index)"
            )
        if not return_logprob:
            return None
        if top_logprobs_num > self.vocab_size:
            return f"top_logprobs_num {top_logprobs_num} exceeds the vocabulary size {self.vocab_size}"
        if logprob_start_len < NO_PROMPT_LOGPROBS:
            return (
                f"logprob_start_len {logprob_start_len} is negative: use -1 (no prompt "
                "logprobs) or a position in [0, prompt length]"
            )
        return None

    def _outside_vocabulary(self, input_ids: Sequence[int]) -> Optional[Tuple[int, int]]:
        """The first ``(position, id)`` outside the vocabulary, or None."""
        if not input_ids or (0 <= min(input_ids) and max(input_ids) < self.vocab_size):
            return None  # one pass each way: the common case costs two C loops
        for position, token in enumerate(input_ids):
            if not 0 <= token < self.vocab_size:
                return position, token
        return None


#: The one lookup from a refusing server's tokenizer manager to its limits (weak). Parked
#: here because SGLang gives no seam to carry it: hooks are resolved by path, a field on the
#: manager would be an attribute set on SGLang's object, and reading the mode per request
#: would re-decide it (``cache_extension._EXTENSIONS`` is the same lookup for caches).
_LIMITS: "weakref.WeakKeyDictionary[Any, RequestLimits]" = weakref.WeakKeyDictionary()


def limits_of(manager: Any) -> Optional[RequestLimits]:
    """``manager``'s limits; None when its server validates as upstream does."""
    return _LIMITS.get(manager)


def refusal_reason(server_args: Any) -> Optional[str]:
    """Why a server built from ``server_args`` refuses: under the flag, or a PD decode;
    None: upstream's validation. Read once per manager."""
    if cp_mode(server_args) is not CpMode.OFF:
        return UNDER_FLAG
    if server_args.disaggregation_mode == DECODE_MODE:
        return ON_PD_DECODE
    return None


def tokenizer_manager_init_after(result: Any, manager: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager.__init__``: on a refusing server (:func:`refusal_reason`),
    attach the limits of the manager's model; decided here, once per manager."""
    reason = refusal_reason(server_args)
    if reason is not None:
        _LIMITS[manager] = RequestLimits(int(manager.model_config.vocab_size), reason)


def validate_one_request_around(original: Callable, manager: Any, obj: Any, input_ids: Any, *args: Any, **kwargs: Any) -> Any:
    """Upstream's checks, then the manager's limits (a refusal raises ``ValueError``, which
    the HTTP server answers with 400 and the message)."""
    result = original(manager, obj, input_ids, *args, **kwargs)
    limits = limits_of(manager)
    if limits is None:
        return result
    problem = limits.problem(
        input_ids,
        text_and_ids=getattr(obj, "text", None) is not None and getattr(obj, "input_ids", None) is not None,
        return_logprob=bool(getattr(obj, "return_logprob", False)),
        top_logprobs_num=int(getattr(obj, "top_logprobs_num", 0) or 0),
        logprob_start_len=int(_or_default(getattr(obj, "logprob_start_len", None))),
    )
    if problem is not None:
        raise ValueError(f"{problem} ({limits.refused_by})")
    return result


def _or_default(logprob_start_len: Optional[int]) -> int:
    return NO_PROMPT_LOGPROBS if logprob_start_len is None else logprob_start_len


__all__ = [
    "ON_PD_DECODE",
    "RequestLimits",
    "UNDER_FLAG",
    "limits_of",
    "refusal_reason",
    "tokenizer_manager_init_after",
    "validate_one_request_around",
]
