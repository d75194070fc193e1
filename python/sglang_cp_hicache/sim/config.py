"""Simulator configuration: one frozen dataclass, picklable, shared by every rank."""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Dict, Optional

# Planted bugs that prove the checkers can fail (debug only, never on by default). Each line
# plants the ones it has a seam for (0.5.23: all but shift_mirror); the
# descriptions name the 0.5.12.post1 seam, sim/v0_5_23/faults.py the 0.5.23 one.
FAULTS = {
    "roll_load_owners": "load-back allocates device pages with owners rolled by one page, "
    "unguarded (as for device tensors on GPU): silent KV corruption",
    "drop_last_rank_loads": "the last rank acks loads without copying host -> device",
    "hot_path_barrier": "match_prefix issues a barrier on the CP group",
    "diverge_last_rank": "the last rank evicts one extra node half-way through the run",
    "leak_tail": "the unaligned tail of finished requests is never freed",
    "shift_mirror": "the host mirror of req_to_token gets each batch's new locs one "
    "position late, so node runs (what backups and evictions plan from) are wrong",
    "drop_last_rank_draft_loads": "the last rank's load-backs copy the target's KV but not "
    "the MTP draft's (needs draft=True): a draft-only loss behind a target hit",
    "pd_wrong_owner": "each prefill rank's PD owner filter sends the next rank's lane from "
    "its own slots (needs pd=True): both sides report Success, decode holds wrong KV",
    "pd_drop_draft": "each prefill rank's PD send drops the MTP draft's blocks (KV and indexer) "
    "before its engine (0.5.23; needs pd=True and draft=True): Success, decode lacks the draft",
    "storage_wrong_bytes": "the last rank's L3 reads land the first page of each read in "
    "host memory with wrong bytes (needs storage_backend): caught only by the hit check",
    "early_layer_ack": "the last rank's per-layer D2H backup acks its forward one layer early "
    "(0.5.23, per-layer backup): the last layer never reaches its host pages",
    "skip_backup_layer": "every rank's forward stores layer 0 without reporting it to the "
    "per-layer D2H backup (0.5.23, per-layer backup): the backup must refuse the forward",
    "early_l3_write": "every rank writes a node to L3 storage when its insert claims per-layer "
    "backup slots, before that backup's ack (0.5.23, per-layer backup, needs storage_backend)",
}

# Which sharding the main column runs (``SimConfig.shard_impl``): the plugin's (upstream's
# sharding with the plugin's hooks where the line has it, the plugin's own CP shared KV on
# 0.5.12.post1), or upstream's native KV sharding alone (0.5.23 and later).
SHARD_IMPLS = ("plugin", "native")

# HiCache L3 backends the simulator attaches (``SimConfig.storage_backend``): the plugin's
# proven set under CP shared KV; the cp-1 upstream column runs upstream's own of each.
STORAGE_BACKENDS = ("file", "mooncake")

# Named workloads: overrides of the SimConfig defaults (``default`` is the defaults).
# ``long``: long system prompts and turns, prompts up to ~3.8K tokens, a 4096-token device
# pool per rank (host ratio as default). 24 active sessions (~58K prompt tokens) outgrow
# the cp-8 logical device pool (32K), so sessions come back from host (about 1 min at cp 8).
WORKLOADS: Dict[str, Dict[str, Any]] = {
    "default": {},
    "long": dict(
        num_requests=240,
        max_active_sessions=24,
        system_prompt_len=1024,
        turn_len_min=128,
        turn_len_max=512,
        reply_len=128,
        max_prompt_len=3840,
        physical_tokens=4096,
    ),
    # ``l3``: the default generator with 16 sessions open at once on a 1.5x host tier, so
    # host eviction drops pages of sessions that come back (HiCache L3 storage hits at
    # cp 2 and 4, not only at cp 1): the storage figures' workload.
    "l3": dict(max_active_sessions=16, hicache_ratio=1.5),
    # ``l3_large``: ``l3`` with 32 sessions open over 400 requests (each growing to 896
    # tokens), more than even cp 4's logical device + host tiers hold (10K tokens), so L3
    # serves ~90-150 pages a lane at cp 4 too: the read-balance figures' sample.
    "l3_large": dict(num_requests=400, max_active_sessions=32, hicache_ratio=1.5),
}


@dataclass(frozen=True)
class SchedulerFeatures:
    """What the driver replays besides plain prefills (identically on every rank)."""

    seed: int = 0
    chunked_prefill_size: int = 0
    abort_prob: float = 0.0
    retract_prob: float = 0.0
    inflight_steps: int = 0
    per_layer_backup: bool = True  # resolved by the line (SimConfig.per_layer_backup)

    def draw(self, kind: str, request_index: int, attempt: int) -> float:
        """A uniform draw that depends only on its arguments: every rank, and the
        baseline, abort and retract the same requests."""
        return random.Random(f"{self.seed}:{kind}:{request_index}:{attempt}").random()


def _bad(message: str) -> None:
    raise ValueError(f"SimConfig: {message}")


@dataclass(frozen=True)
class SimConfig:
    """Everything one simulation run needs; the defaults take about 20 s on 2 cores."""

    cp_size: int = 2
    seed: int = 0
    workload: str = "default"  # key of WORKLOADS; set with SimConfig.preset
    # ---- workload: built-in generator (ignored when ``trace_path`` is set)
    num_requests: int = 200
    num_system_prompts: int = 3
    system_prompt_len: int = 256
    turn_len_min: int = 32
    turn_len_max: int = 160
    reply_len: int = 48  # model output of the previous turn, part of the next prompt
    max_prompt_len: int = 896  # a session ends once its next prompt would be longer
    max_active_sessions: int = 8
    continue_prob: float = 0.75  # next request continues an active session (prefix reuse)
    vocab_size: int = 32000
    trace_path: Optional[str] = None  # JSONL trace instead of the generator
    batch_size: int = 1  # requests per prefill batch (scheduler step)
    # ---- scheduler features around the backup state machine
    chunked_prefill_size: int = 0  # tokens per prefill chunk (multiple of page_size); 0 = off
    abort_prob: float = 0.0  # a scheduled request is aborted before its forward
    retract_prob: float = 0.0  # after a forward (chunk): KV freed uninserted, request re-queued
    inflight_steps: int = 0  # write acks land this many steps after submission (0: at once)
    # New leaves' backups reserved before the forward move during it, layer by layer (the
    # forward reports each layer's end as the NSA hook does); False: all layers at once at
    # the insert. Hit-count and write-back backups are all-layer either way. None: the
    # line's default (0.5.12.post1: per layer; 0.5.23: per layer on the plugin column, either
    # host layout; native and upstream columns: all layers).
    per_layer_backup: Optional[bool] = None
    # ---- one rank's stack (nsa_stack.StackConfig)
    layer_num: int = 2
    page_size: int = 64
    physical_tokens: int = 1024  # device KV pool per rank, in tokens
    hicache_ratio: float = 2.0  # host pool per rank = ratio x device pool per rank
    io_backend: Optional[str] = None  # None: the line's ("direct" on 0.5.12.post1, "kernel" on 0.5.23)
    # HiCache host layout; None: the line's, upstream's own default (layer_first on
    # 0.5.12.post1, page_first on 0.5.23), so a run without it simulates a default launch.
    mem_layout: Optional[str] = None
    # The MTP draft: a 1-layer NSA pool beside the target's (0.5.12.post1: CP ranks, not the
    # baseline, kept on host from the same budget; 0.5.23: every column, packed by upstream
    # as the host pools' tail layer in the same slots); every hit checks target and draft.
    draft: bool = False
    # ---- columns
    # The main column: "plugin" (the plugin's CP shared KV; on 0.5.23 upstream's sharding
    # with the plugin's hooks applied) or "native" (upstream's sharding alone: 0.5.23 only).
    shard_impl: str = "plugin"
    # Beside a plugin run, replay through upstream's native sharding alone (the "native"
    # column) where the line has it (0.5.23); 0.5.12.post1 has none, its column reads n/a.
    native_column: bool = True
    baseline: bool = True  # replay through upstream's unsharded cache (cp 1, same pool)
    # ---- PD disaggregation: every finished prefill of the main column is transferred from
    # its prefill ranks to one decode process (a full, unsharded pool) over a real Mooncake
    # transfer engine on loopback TCP and checked there byte for byte (sim/pd.py). Off by
    # default: it adds the decode and bootstrap processes and one transfer per request.
    pd: bool = False
    # ---- HiCache L3 storage (0.5.23 line): None, "file" or "mooncake". The plugin column
    # writes and reads with owner-free keys, the cp-1 upstream column with upstream's own
    # backend; the native column runs without (upstream refuses storage under sharding).
    # Every storage hit loads back like a host hit and is byte-checked the same way.
    storage_backend: Optional[str] = None
    # The file backend's folder (one subfolder per column), kept between runs: a later run
    # at any cp size reads the pages an earlier one stored. None: a temporary folder.
    # Mooncake: the run starts its own mooncake_master on loopback and stops it at the end.
    storage_dir: Optional[str] = None
    # Mooncake: the host:port of a running mooncake_master whose store outlives the run
    # (a segment held by a mooncake_client: ``python -m sglang_cp_hicache.sim.v0_5_23.held_store``).
    # The plugin column's clients mount no segment of their own, so every page lands in
    # the held one and a later run, at any cp size, reads what this one stored (a
    # restart); the other columns keep a master of their own for the run.
    storage_mooncake_master: Optional[str] = None
    # Beside the cp-1 upstream column (the same memory per rank), replay upstream cp 1 once
    # more with cp_size x the per-rank device and host pools (the ``upstream_logical``
    # column, its own L3 folder or master): the same logical L1 + L2 as the cp ranks'
    # owner lanes together. The plugin's tiers hold cp x upstream's tokens per rank, so
    # reuse upstream must fetch from L3 the plugin finds on device or host; "storage hit
    # tokens >= upstream's" is judged against this column, where L2 holds the same.
    storage_logical_baseline: bool = False
    # ---- run
    tree_digest_every: int = 8  # steps between full radix-tree digests in the decision log
    progress: bool = False  # tqdm on rank 0 (stderr)
    timeout_s: float = 300.0  # gloo timeout, and the longest a launch may go without a step (PD: a transfer)
    log_level: str = "WARNING"
    fault: Optional[str] = None  # key of FAULTS (tests of the checkers)

    def __post_init__(self) -> None:
        self._check_workload()
        self._check_stack()
        self._check_columns()
        self._check_schedule()

    def _check_workload(self) -> None:
        if self.workload not in WORKLOADS:
            _bad(f"workload must be one of {sorted(WORKLOADS)}, got {self.workload!r}")
        if self.cp_size < 1:
            _bad(f"cp_size must be >= 1, got {self.cp_size}")
        if self.num_requests < 1 and self.trace_path is None:
            _bad("num_requests must be >= 1")
        if not 1 <= self.turn_len_min <= self.turn_len_max:
            _bad(
                "need 1 <= turn_len_min <= turn_len_max, got "
                f"{self.turn_len_min}, {self.turn_len_max}"
            )
        if self.system_prompt_len < 0 or self.reply_len < 0 or self.num_system_prompts < 0:
            _bad("lengths and counts must be >= 0")
        if self.max_active_sessions < 1 or self.batch_size < 1:
            _bad("max_active_sessions and batch_size must be >= 1")
        if not 0.0 <= self.continue_prob <= 1.0:
            _bad(f"continue_prob must be in [0, 1], got {self.continue_prob}")

    def _check_stack(self) -> None:
        if self.physical_tokens % self.page_size or self.physical_tokens < self.page_size:
            _bad(f"physical_tokens ({self.physical_tokens}) must be a multiple of page_size")
        if self.hicache_ratio <= 1.0:
            _bad(f"hicache_ratio must be > 1 (SGLang's rule), got {self.hicache_ratio}")
        if self.io_backend not in (None, "direct", "kernel"):
            _bad(f"io_backend must be 'direct' or 'kernel', got {self.io_backend!r}")

    def _check_columns(self) -> None:
        """The comparison columns, the PD and L3 options and the planted faults."""
        if self.shard_impl not in SHARD_IMPLS:
            _bad(f"shard_impl must be one of {list(SHARD_IMPLS)}, got {self.shard_impl!r}")
        if self.fault is not None and self.fault not in FAULTS:
            _bad(f"fault must be one of {sorted(FAULTS)}, got {self.fault!r}")
        if self.fault == "drop_last_rank_draft_loads" and not self.draft:
            _bad("fault 'drop_last_rank_draft_loads' needs draft=True")
        if self.fault == "pd_wrong_owner" and not self.pd:
            _bad("fault 'pd_wrong_owner' needs pd=True")
        if self.fault == "pd_drop_draft" and not (self.pd and self.draft):
            _bad("fault 'pd_drop_draft' needs pd=True and draft=True")
        if self.pd and self.cp_size < 2:
            _bad("pd=True needs cp_size >= 2 (the prefill ranks shard the KV they send)")
        if self.storage_backend is not None and self.storage_backend not in STORAGE_BACKENDS:
            _bad(f"storage_backend must be one of {list(STORAGE_BACKENDS)}, got {self.storage_backend!r}")
        if self.storage_dir is not None and self.storage_backend != "file":
            _bad("storage_dir is the file backend's folder: it needs storage_backend='file'")
        if self.storage_mooncake_master is not None and self.storage_backend != "mooncake":
            _bad("storage_mooncake_master is a Mooncake store: it needs storage_backend='mooncake'")
        if self.storage_logical_baseline and self.storage_backend is None:
            _bad("storage_logical_baseline compares L3 hits: it needs storage_backend")
        if self.fault in ("storage_wrong_bytes", "early_l3_write") and self.storage_backend is None:
            _bad(f"fault {self.fault!r} needs storage_backend")

    def _check_schedule(self) -> None:
        if self.pd and self.page_size != 64:
            _bad(f"pd=True runs the PD harness's page size 64, got page_size={self.page_size}")
        if self.chunked_prefill_size < 0 or self.chunked_prefill_size % self.page_size:
            _bad(
                f"chunked_prefill_size ({self.chunked_prefill_size}) must be 0 or a "
                "positive multiple of page_size"
            )
        for name in ("abort_prob", "retract_prob"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _bad(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if self.inflight_steps < 0:
            _bad(f"inflight_steps must be >= 0, got {self.inflight_steps}")
        if self.tree_digest_every < 1:
            _bad("tree_digest_every must be >= 1")

    @classmethod
    def preset(cls, workload: str, **overrides: Any) -> "SimConfig":
        """The named workload's settings (``WORKLOADS``), then ``overrides`` on top."""
        settings = {**WORKLOADS.get(workload, {}), **overrides}
        return cls(workload=workload, **settings)  # __post_init__ rejects an unknown name

    def scheduler_features(self, per_layer_backup: bool) -> "SchedulerFeatures":
        """The driver's scheduler features; ``per_layer_backup`` as the line resolved it."""
        return SchedulerFeatures(
            seed=self.seed,
            chunked_prefill_size=self.chunked_prefill_size,
            abort_prob=self.abort_prob,
            retract_prob=self.retract_prob,
            inflight_steps=self.inflight_steps,
            per_layer_backup=per_layer_backup,
        )

    def runs_native_column(self) -> bool:
        """Whether a native-sharding comparison column is asked for (lines with native
        sharding only; the line decides whether it can run)."""
        return self.native_column and self.shard_impl == "plugin"
