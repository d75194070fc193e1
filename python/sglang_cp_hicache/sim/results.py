"""What one simulated rank hands back to the parent (plain picklable dataclasses)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

# Scheduler-path operations timed per prefill batch.
OPS = ("match_prefix", "load_back", "alloc", "insert", "check_events", "evict")


@dataclass
class RankCounters:
    """Scheduler-visible outcomes; all but the kv_* / owned_* fields are replicated."""

    requests: int = 0
    prompt_tokens: int = 0
    device_hit_tokens: int = 0  # matched on device by match_prefix
    host_matched_tokens: int = 0  # host_hit_length reported by match_prefix
    host_hit_tokens: int = 0  # of those, loaded back and used
    load_backs: int = 0  # init_load_back calls that loaded something
    load_back_failures: int = 0  # host hit but nothing loaded (threshold, quota, no room)
    device_evicted_nodes: int = 0
    device_evicted_tokens: int = 0  # demoted to host + dropped
    device_dropped_tokens: int = 0  # not backed up: KV gone
    host_evicted_nodes: int = 0
    host_evicted_tokens: int = 0  # logical
    logical_written_tokens: int = 0  # backups landed on host (logical)
    logical_loaded_tokens: int = 0  # load-backs queued (logical)
    # Scheduler features and the pending-backup state machine.
    prefill_chunks: int = 0  # unfinished chunks cached (cache_unfinished_req, chunked)
    aborted_requests: int = 0  # aborted after admission, before their forward
    retracted_requests: int = 0  # KV freed uninserted after a forward, re-queued
    deferred_requests: int = 0  # request-rounds left waiting: a pending backup would split
    pending_committed: int = 0  # backups made host-visible by their final ack (CP)
    pending_rolled_back: int = 0  # reservations freed without a commit (CP; flush included)
    deferred_splits: int = 0  # matches that stopped above a pending backup (CP)
    backups_skipped_host_full: int = 0  # no host room on a short lane after the retry (CP)
    # Per-layer D2H backup (0.5.23's plugin column): forwards that carried reserved backups,
    # the layers they reported to the backup (each layer's store) and the acks they appended
    # (one per forward, after its last layer). Replicated: a rank owning none acks too.
    per_layer_forwards: int = 0
    per_layer_layers: int = 0
    per_layer_acks: int = 0
    # L3 writes (``write_storage`` calls) of host slots a per-layer backup filled, all
    # issued after its ack (checked). Replicated. 0 without storage.
    per_layer_l3_writes: int = 0
    # Inserts the tree refused (0.5.23 under sharding: the key would join two rotation
    # runs; the request keeps its own pages, freed at release), and the hits they cost:
    # later prompt tokens a refused key would have matched beyond the real match (an upper
    # bound: the refused KV could have been evicted since). 0 on 0.5.12.post1.
    rejected_inserts: int = 0
    rejected_insert_tokens: int = 0
    rejected_insert_hit_tokens: int = 0
    # L3 storage (SimConfig.storage_backend): prompt tokens of first chunks that came from
    # storage (prefetched to host, then loaded back with the host hit). 0 without storage.
    storage_hit_tokens: int = 0
    # Per rank (not replicated): the owned shard of every hit was checked.
    kv_checked_tokens: int = 0  # owned tokens of hits compared with the pattern
    kv_mismatches: int = 0
    draft_kv_checked_tokens: int = 0  # the same tokens' MTP draft KV (SimConfig.draft)
    draft_kv_mismatches: int = 0

    def count_first_chunk(
        self, prompt_tokens: int, device_hit: int, host_matched: int, loaded: int, mismatches: int, checked: int
    ) -> None:
        """A request's first chunk ran: its prompt, its hit (on device, matched on host,
        loaded back) and the check of its owned hit tokens."""
        self.kv_mismatches += mismatches
        self.kv_checked_tokens += checked
        self.requests += 1
        self.prompt_tokens += prompt_tokens
        self.device_hit_tokens += device_hit
        self.host_matched_tokens += host_matched
        self.host_hit_tokens += loaded
        self.load_backs += int(loaded > 0)
        self.load_back_failures += int(host_matched > 0 and loaded == 0)


@dataclass
class SeriesPoint:
    """State after one step, for the plot."""

    requests: int
    prompt_tokens: int
    hit_tokens: int  # device + loaded-back host hits, cumulative
    host_physical_bytes: int
    host_logical_bytes: int


@dataclass
class LaneUsage:
    """Used pages per owner lane (lane r is rank r's physical pool), sampled after every
    step: each lane's peak and the last sample. Replicated: every rank sees every lane."""

    device_peak: List[int]
    device_final: List[int]
    host_peak: List[int]
    host_final: List[int]

    @classmethod
    def empty(cls, cp_size: int) -> "LaneUsage":
        return cls([0] * cp_size, [0] * cp_size, [0] * cp_size, [0] * cp_size)

    def sample(self, device_used: List[int], host_used: List[int]) -> None:
        self.device_peak = [max(a, b) for a, b in zip(self.device_peak, device_used)]
        self.host_peak = [max(a, b) for a, b in zip(self.host_peak, host_used)]
        self.device_final = list(device_used)
        self.host_final = list(host_used)


@dataclass
class PDRankStats:
    """One prefill rank's side of the PD transfers (``SimConfig.pd``): every finished
    request it sent to the decode process, in finish order (replicated on every rank)."""

    requests: int = 0
    tokens: int = 0  # prompt tokens of the requests transferred
    pages: int = 0  # logical pages of those requests
    owned_pages: int = 0  # of those, pages this rank owns (and so sends)
    page_bytes: int = 0  # bytes of one logical page over every pool sent (KV, indexer, draft)
    sent_bytes: int = 0  # KV and state bytes this rank handed to its transfer engine (no aux)
    transfer_s: List[float] = field(default_factory=list)  # last chunk sent -> CP-wide Success
    engine_s: float = 0.0  # inside the engine's batch writes, all requests
    failures: List[str] = field(default_factory=list)
    # Pages this rank sent, by position-page in the prompt (index P: how many requests'
    # page P it owned): where the send balance comes from (shared prefixes are the first P).
    owned_by_position: List[int] = field(default_factory=list)

    def count_owned_positions(self, position_pages: Sequence[int]) -> None:
        for page in position_pages:
            if page >= len(self.owned_by_position):
                self.owned_by_position.extend([0] * (page + 1 - len(self.owned_by_position)))
            self.owned_by_position[page] += 1


@dataclass
class PDDecodeStats:
    """The decode process's checks of every transfer, on its own full (cp 1) pool."""

    requests: int = 0
    tokens: int = 0  # prompt tokens received and checked
    kv_mismatches: int = 0  # tokens whose target KV or indexer bytes differ from the pattern
    draft_kv_mismatches: int = 0  # tokens whose MTP draft KV or indexer bytes differ
    aux_mismatches: int = 0  # requests whose first token (MTP: hidden state) differs
    off_grant_pages_changed: int = 0  # pages never granted to a request whose bytes changed
    leaked_tokens: int = 0  # KV slots not back after every request was released
    failures: List[str] = field(default_factory=list)
    transfer_s: List[float] = field(default_factory=list)  # preallocated -> transferred


@dataclass
class StorageRankStats:
    """One rank's L3 traffic (``SimConfig.storage_backend``): KV pages through the
    controller's page functions, each counted as a whole page of every component."""

    backend: str
    backend_class: str  # the backend the factory built (owner-free or upstream's)
    written_pages: int = 0
    read_pages: int = 0
    prior_run_read_pages: int = 0  # of the reads, pages an earlier run had stored (file)
    page_bytes: int = 0  # bytes of one page over every host pool (KV + indexer)
    rejected_reads: int = 0  # reads the owner-free file backend refused (wrong size)
    prefetches_issued: int = 0  # arrivals whose L3 prefetch was submitted
    requeries: int = 0  # prefetches re-issued at admission: a prefix lost in the queue
    anchor_skips: int = 0  # prefetches the plugin did not issue: match below a pending backup

    @property
    def written_bytes(self) -> int:
        return self.written_pages * self.page_bytes

    @property
    def read_bytes(self) -> int:
        return self.read_pages * self.page_bytes


@dataclass
class RankResult:
    rank: int
    shared_kv: bool
    counters: RankCounters
    op_samples_us: Dict[str, List[float]]  # scheduler-thread CPU time per batch
    op_wall_samples_us: Dict[str, List[float]]
    decision_hash: str
    tree_digest: str  # before the final flush
    tree_nodes: int
    violations: List[str]
    hot_path_collectives: Dict[str, int]
    allowed_collectives: int
    bytes_per_token: int
    d2h_bytes: int  # this rank's physical D2H (owned pages; every token on cp 1)
    h2d_bytes: int
    host_peak_physical_bytes: int
    host_peak_logical_bytes: int
    leaked_device_slots: int
    leaked_host_slots: int
    leaked_req_slots: int
    steps_run: int
    series: List[SeriesPoint] = field(default_factory=list)
    lane_usage: Optional[LaneUsage] = None  # CP ranks only
    stopped_early: Optional[str] = None
    # The MTP draft's share (SimConfig.draft; 0 without): its host pools' bytes per token
    # and this rank's physical draft bytes moved / held at peak (in the same slots).
    draft_bytes_per_token: int = 0
    draft_d2h_bytes: int = 0
    draft_h2d_bytes: int = 0
    draft_host_peak_bytes: int = 0
    pd: Optional[PDRankStats] = None  # SimConfig.pd: this rank's transfers to decode
    storage: Optional[StorageRankStats] = None  # SimConfig.storage_backend: this rank's L3
