"""HTTP ``/generate`` for the serving harness: greedy completions over token ids, streamed so
the time to the first token is measured where a user sees it (through the router)."""

from __future__ import annotations

import json
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
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
    :class:`RequestFailed` on an HTTP error or a stream that reports one."""
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
    first: Optional[float] = None
    last: Optional[dict] = None
    ids: List[int] = []
    logprobs: List[float] = []
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            if not stream:
                last = json.loads(response.read().decode())
                first = time.monotonic()
            for raw in response if stream else ():
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
    except urllib.error.HTTPError as error:
        body = error.read().decode(errors="replace")
        raise RequestFailed(f"HTTP {error.code}: {body[:300]}", error.code, body) from None
    except OSError as error:
        raise RequestFailed(f"no answer: {error!r}") from None
    if last is None:
        raise RequestFailed("empty stream")
    meta = last.get("meta_info", {})
    for entry in meta.get("output_token_logprobs") or []:
        logprobs.append(float(entry[0]))
        ids.append(int(entry[1]))
    return Completion(
        output_ids=tuple(last.get("output_ids") or ids),
        logprobs=tuple(logprobs),
        prompt_tokens=int(meta.get("prompt_tokens", 0)),
        cached_tokens=int(meta.get("cached_tokens", 0) or 0),
        cached_by_tier=_cached_by_tier(meta),
        ttft_s=(first or time.monotonic()) - start,
        e2e_s=time.monotonic() - start,
    )


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


__all__ = ["Completion", "REQUEST_TIMEOUT_S", "RequestFailed", "TIERS", "generate", "post"]
