"""HTTP ``/generate`` for the serving harness: greedy completions over token ids, streamed so
the time to the first token is measured where a user sees it (through the router).

An answer is a success only when it carries tokens: SGLang reports a request it aborted
(a PD transfer that timed out, ``/abort_request``) as a final chunk or body whose
``meta_info.finish_reason`` is ``{"type": "abort", "status_code": ...}``, under HTTP 200 when
streamed, with no ``error`` key and ``output_ids: []``. :func:`generate` raises
:class:`RequestFailed` for it (``status`` its status code), for an answer with no tokens and
for a stream that ends without a finish reason."""

from __future__ import annotations

import http.client
import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

REQUEST_TIMEOUT_S = 180.0
TIERS = ("device", "host", "storage")


class RequestFailed(RuntimeError):
    """``/generate`` answered with an error; ``status`` is the HTTP status (0: no answer)."""

    def __init__(self, message: str, status: int = 0, body: str = ""):
        super().__init__(message)
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Completion:
    """One greedy completion as the server reported it."""

    output_ids: Tuple[int, ...]
    logprobs: Tuple[float, ...]
    prompt_tokens: int
    cached_tokens: int
    cached_by_tier: Dict[str, int]
    ttft_s: float
    e2e_s: float
    #: speculative decoding's per-request figures (``meta_info``'s ``spec_*`` fields:
    #: ``spec_verify_ct``, ``spec_accept_length``, ...); empty without speculative decoding
    spec: Dict[str, float] = field(default_factory=dict)

    def tier(self, name: str) -> int:
        return self.cached_by_tier.get(name, 0)


def _cached_by_tier(meta: dict) -> Dict[str, int]:
    details = meta.get("cached_tokens_details") or {}
    tiers = {tier: int(details.get(tier, 0) or 0) for tier in TIERS}
    if not details and meta.get("cached_tokens"):
        tiers["device"] = int(meta["cached_tokens"])  # no HiCache report: all on device
    return tiers


def generate(
    url: str,
    input_ids: Sequence[int],
    max_new_tokens: int,
    timeout_s: float = REQUEST_TIMEOUT_S,
    extra: Optional[dict] = None,
    stream: bool = True,
) -> Completion:
    """Greedy ``/generate`` (EOS ignored, so every completion has ``max_new_tokens``),
    streamed unless ``stream=False`` (then the TTFT is the whole request's time); raises
    :class:`RequestFailed` on an HTTP error, a stream that reports one, an abort reported
    under HTTP 200 and an answer without tokens (:func:`check_finished`)."""
    payload = {
        "input_ids": list(input_ids),
        "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True},
        "return_logprob": True,
        "stream": stream,
        **(extra or {}),
    }
    request = urllib.request.Request(
        f"{url}/generate", data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    start = time.monotonic()
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if stream:
                first, last = _read_stream(response)
            else:
                last, first = json.loads(response.read().decode()), time.monotonic()
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        raise RequestFailed(f"HTTP {error.code}: {body[:300]}", error.code, body) from None
    except (OSError, http.client.HTTPException) as error:
        raise RequestFailed(f"no answer: {error!r}") from None
    except ValueError as error:  # a body or chunk that is not JSON
        raise RequestFailed(f"unreadable answer: {error}") from None
    if last is None:
        raise RequestFailed("empty stream")
    meta = last.get("meta_info", {})
    ids: List[int] = []
    logprobs: List[float] = []
    for entry in meta.get("output_token_logprobs") or []:
        logprobs.append(float(entry[0]))
        ids.append(int(entry[1]))
    output_ids = tuple(last.get("output_ids") or ids)
    check_finished(meta, len(output_ids), max_new_tokens, json.dumps(last)[:2000])
    return Completion(
        output_ids=output_ids,
        logprobs=tuple(logprobs),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        cached_by_tier=_cached_by_tier(meta),
        ttft_s=(first or time.monotonic()) - start,
        e2e_s=time.monotonic() - start,
        spec={key: float(value) for key, value in meta.items() if key.startswith("spec_") and isinstance(value, (int, float))},
    )


def _read_stream(response) -> Tuple[Optional[float], Optional[dict]]:
    """An SSE ``/generate`` stream: when its first chunk came, and its last chunk; raises
    :class:`RequestFailed` for a chunk that reports an error."""
    first: Optional[float] = None
    last: Optional[dict] = None
    for raw in response:
        line = raw.decode().strip()
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            break
        chunk = json.loads(data)
        if "error" in chunk:
            error = chunk["error"]
            code = int(error.get("code", 200)) if isinstance(error, dict) else 200
            raise RequestFailed(f"stream error: {error}", code, data)
        if first is None:
            first = time.monotonic()
        last = chunk
    return first, last


def check_finished(meta: dict, output_tokens: int, max_new_tokens: int, body: str = "") -> None:
    """Raise :class:`RequestFailed` unless ``meta`` (a final answer's ``meta_info``) reports a
    finished request with tokens: an abort (its ``status_code``, else 0), no finish reason
    (a stream cut short), or no output token where some were asked for."""
    reason = meta.get("finish_reason")
    if isinstance(reason, dict) and reason.get("type") == "abort":
        status = int(reason.get("status_code") or 0)
        raise RequestFailed(f"aborted under HTTP 200 (status {status}): {reason.get('message', '')[:300]}", status, body)
    if reason is None:
        raise RequestFailed("the answer ended without a finish reason", 0, body)
    if max_new_tokens > 0 and output_tokens == 0:
        raise RequestFailed(f"an empty success: no output token of {max_new_tokens} asked (finish {reason})", 0, body)


def post(url: str, path: str, body: bytes, timeout_s: float = 60.0) -> Tuple[int, str]:
    """``POST url/path`` with raw ``body``: (status, text); status 0 when nothing answered."""
    request = urllib.request.Request(f"{url}{path}", data=body, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            return response.status, response.read().decode(errors="replace")
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode(errors="replace")
    except OSError as error:
        return 0, repr(error)


__all__ = ["Completion", "REQUEST_TIMEOUT_S", "RequestFailed", "TIERS", "check_finished", "generate", "post"]
