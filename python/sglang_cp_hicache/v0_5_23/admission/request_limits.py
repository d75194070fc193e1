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

The checks run AROUND ``TokenizerManager._validate_one_request``, after upstream's own, for
a manager built under the flag: the mode is read once, when the manager is built
(:func:`tokenizer_manager_init_after`), and per request the hook asks only whether the
manager has limits. Flag off: upstream's validation, unchanged.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Tuple

from sglang_cp_hicache.v0_5_23.launch.cp_mode import CpMode, cp_mode
from sglang_cp_hicache.v0_5_23.launch.flag import CLI_FLAG

#: ``logprob_start_len``'s default: no prompt logprobs.
NO_PROMPT_LOGPROBS = -1


@dataclass(frozen=True)
class RequestLimits:
    """What one request must satisfy beyond upstream's checks; ``vocab_size`` is the
    model's (token ids index its embedding and logits)."""

    vocab_size: int

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


#: The one lookup from a tokenizer manager built under the flag to its limits (weak). Parked
#: here because SGLang gives no seam to carry it: hooks are resolved by path, a field on the
#: manager would be an attribute set on SGLang's object, and reading the mode per request
#: would re-decide it (``cache_extension._EXTENSIONS`` is the same lookup for caches).
_LIMITS: "weakref.WeakKeyDictionary[Any, RequestLimits]" = weakref.WeakKeyDictionary()


def limits_of(manager: Any) -> Optional[RequestLimits]:
    """``manager``'s limits; None when it was built with the flag off."""
    return _LIMITS.get(manager)


def tokenizer_manager_init_after(result: Any, manager: Any, server_args: Any, *args: Any, **kwargs: Any) -> None:
    """AFTER ``TokenizerManager.__init__``: under the flag (any mode but off), attach the
    limits of the manager's model; the mode is read here, once per manager."""
    if cp_mode(server_args) is not CpMode.OFF:
        _LIMITS[manager] = RequestLimits(int(manager.model_config.vocab_size))


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
        raise ValueError(f"{problem} (refused under {CLI_FLAG})")
    return result


def _or_default(logprob_start_len: Optional[int]) -> int:
    return NO_PROMPT_LOGPROBS if logprob_start_len is None else logprob_start_len


__all__ = ["RequestLimits", "limits_of", "tokenizer_manager_init_after", "validate_one_request_around"]
