"""What a PD scenario is made of, for both lines: requests and device evictions in order,
the planted negative controls, and what each role reports back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple, Union


# ------------------------------------------------------------------ scenario steps and outcomes
SENTINEL_BYTE = 0xA5  # a decode pool's bytes before any transfer


@dataclass(frozen=True)
class PDRequest:
    """One request, served by every prefill rank and the decode server in scenario order.

    ``chunk_tokens`` splits the prefill into forwards the way SGLang's chunked prefill
    does (the first chunk ends on a page boundary). ``bootstrap_port`` (decode only)
    overrides the cluster's: a port nobody serves makes the bootstrap unreachable.
    """

    rid: str
    token_ids: Tuple[int, ...]
    room: int
    chunk_tokens: Optional[int] = None
    bootstrap_port: Optional[int] = None

    @property
    def next_token(self) -> int:
        """The first output token the prefill hands to decode as aux data."""
        return (sum(self.token_ids) + len(self.token_ids)) % 50000 + 1


@dataclass(frozen=True)
class EvictDevice:
    """Prefill step: back everything up, evict it from device and wipe the device bytes, so
    a later hit on it can only come back through a real host load-back."""


Step = Union[PDRequest, EvictDevice]

#: The negative controls both lines' harnesses plant in the prefill side's owner filter
#: (what each breaks: the line's ``PDScenario``).
PLANTS = ("wrong_owner", "rank_skips_send")


class ScenarioSteps:
    """What both lines' ``PDScenario`` (frozen dataclasses with ``steps`` and ``plants``,
    request id -> one of :data:`PLANTS`) read of their steps."""

    steps: Tuple[Step, ...]
    plants: Tuple[Tuple[str, str], ...]

    def check_plants(self) -> None:
        for rid, plant in self.plants:
            if plant not in PLANTS:
                raise ValueError(f"plant {plant!r} for {rid}: choose from {PLANTS}")

    @property
    def requests(self) -> List[PDRequest]:
        return [s for s in self.steps if isinstance(s, PDRequest)]

    def plant_for(self, rid: str) -> Optional[str]:
        """The bug planted while request ``rid`` is served (None: none)."""
        return dict(self.plants).get(rid)


@dataclass
class PrefillOutcome:
    """One prefill rank's view of one request.

    ``payload_bytes``: KV and state bytes this rank handed to its transfer engine (aux
    excluded); ``owned_pages``: pages of the request this rank owns.
    """

    rid: str
    rank: int
    success: bool
    failure: str = ""
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    chunks: int = 0
    transfer_s: float = 0.0  # last chunk sent -> CP-wide Success (or Failed) polled
    engine_s: float = 0.0  # time inside the transfer engine's batch writes, all chunks
    failure_detected_s: float = 0.0  # from the checkpoint's release to the Failed poll
    payload_bytes: int = 0
    owned_pages: int = 0
    pools_unchanged: bool = True
    leaked: List[str] = field(default_factory=list)


@dataclass
class DecodeOutcome:
    """The decode server's view of one request, checked on its own pool."""

    rid: str
    success: bool
    failure: str = ""
    kv_mismatches: int = 0  # tokens whose target KV or indexer bytes differ from the reference
    draft_mismatches: int = 0  # tokens whose draft KV or indexer bytes differ
    aux_ok: bool = False  # first output token (and, with MTP, hidden state) as prefill set them
    granted_pages: int = 0
    granted_pages_touched: int = 0  # of a failed request: granted pages whose bytes changed
    transfer_s: float = 0.0
    errors_logged: List[str] = field(default_factory=list)


@dataclass
class DecodeReport:
    """The decode role's result: per request, then the end-of-run checks over the pool."""

    outcomes: List[DecodeOutcome]
    final_kv_mismatches: int  # every successful request re-checked after all transfers
    final_draft_mismatches: int
    off_grant_pages_changed: int  # pages never granted to a request whose bytes changed
    final_planted_kv_mismatches: int  # the planted (negative-control) requests, re-checked apart


# ------------------------------------------------------------------ the simulator's PD tests
#: ``SimConfig`` fields of both lines' simulator PD tests: small pools so the trace hits on
#: device and loads back from host; chunks and a retraction so the transfers cover a
#: finished chunked prefill and skip a retracted attempt; the main column only.
SIM_PD_SMALL_TRACE: Dict[str, Any] = dict(
    cp_size=2,
    seed=0,
    num_requests=12,
    physical_tokens=512,
    max_prompt_len=448,
    system_prompt_len=128,
    turn_len_min=32,
    turn_len_max=96,
    reply_len=32,
    chunked_prefill_size=128,
    retract_prob=0.1,
    baseline=False,
    native_column=False,
    pd=True,
    timeout_s=150,
)


__all__ = [
    "DecodeOutcome",
    "DecodeReport",
    "EvictDevice",
    "PLANTS",
    "PDRequest",
    "PrefillOutcome",
    "SENTINEL_BYTE",
    "SIM_PD_SMALL_TRACE",
    "ScenarioSteps",
    "Step",
]
