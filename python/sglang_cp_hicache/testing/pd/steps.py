"""What a prefill rank and the decode server of either line do around upstream's PD path:
:class:`PrefillSteps` (bootstrap, poll to the end, close the sender) and
:class:`DecodeChecks` (serve a request and check every byte that landed)."""

from __future__ import annotations

import time
from typing import Any, Callable, ContextManager, Dict, List, Optional

from sglang_cp_hicache.testing.pd.cluster import hold_if_asked
from sglang_cp_hicache.testing.pd.roles import REGISTERED, RoleChannel
from sglang_cp_hicache.testing.pd.scenario import (
    DecodeOutcome,
    DecodeReport,
    EvictDevice,
    PDRequest,
    PrefillOutcome,
)


# ------------------------------------------------------------------ the roles' shared steps
_POLL_S = 0.01


def load_plugins() -> None:
    """The plugin loaded as SGLang loads it (the installed line's hooks applied)."""
    import sglang.srt.plugins as sglang_plugins

    if not sglang_plugins._plugins_loaded:
        sglang_plugins.load_plugins()


class PrefillSteps:
    """What a prefill rank of either line does around upstream's PD prefill path.

    The line's class sets ``ctx`` (its CP group), ``scenario``, ``stack`` (its rank stack),
    ``queue`` (upstream's ``PrefillBootstrapQueue``), ``kv_manager``, ``meter`` (a
    ``SentBytesMeter``), ``metadata_allocator``, ``baseline`` (from ``_resources``) and
    defines ``_free_kv()`` (free logical KV tokens), ``_poll(req)`` (the CP-all-reduced
    poll), ``evict_device()`` and ``serve(channel, spec)``.
    """

    def serve_steps(
        self, channel: RoleChannel, planted_filter: Callable[[Optional[str], int, int], ContextManager]
    ) -> List[PrefillOutcome]:
        """Registered, held if the scenario asks, then the scenario's steps in order: each
        request (to this cluster's bootstrap) served under its plant, ``EvictDevice`` evicts."""
        channel.event(REGISTERED)
        hold_if_asked(channel, self.scenario)
        outcomes = []
        for step in self.scenario.steps:
            if isinstance(step, EvictDevice):
                self.evict_device()
            elif step.bootstrap_port is None:  # requests to another bootstrap never reach prefill
                with planted_filter(self.scenario.plant_for(step.rid), self.ctx.rank, self.scenario.cp_size):
                    outcomes.append(self.serve(channel, step))
        return outcomes

    def _resources(self) -> Dict[str, int]:
        """What a finished request must give back: free + evictable logical KV, request
        slots, metadata slots, and no locked tree tokens."""
        cache = self.stack.cache
        return {
            "kv_free_or_evictable": self._free_kv() + cache.evictable_size(),
            "req_slots": self.stack.req_to_token_pool.available_size(),
            "metadata_slots": self.metadata_allocator.available_size(),
            "locked_tokens": cache.protected_size(),
        }

    def _payload_bytes(self, out: PrefillOutcome, bytes_before: int) -> int:
        """The bytes sent since ``bytes_before`` less the aux data (sent on success only)."""
        aux_bytes = sum(self.kv_manager.kv_args.aux_item_lens) if out.success else 0
        return self.meter.total - bytes_before - aux_bytes

    def _leaks(self) -> List[str]:
        now = self._resources()
        return [f"{k}: {self.baseline[k]} -> {v}" for k, v in now.items() if v != self.baseline[k]]

    def _local_state(self, req: Any) -> str:
        """This rank's own view of ``req``'s transfer (before the CP all-reduce)."""
        room, mgr = req.bootstrap_room, self.kv_manager
        where = "in" if room in mgr.transfer_infos else "not in"
        return f"local status {mgr.request_status.get(room)}, decode metadata {where} transfer_infos"

    def _bootstrap(self, req: Any, deadline: float) -> bool:
        """Queue ``req``; poll upstream's bootstrap queue until decode's metadata reached
        every rank (True) or the request failed (False)."""
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        self.queue.add(req, num_kv_heads=1)
        while True:
            if self.queue.pop_bootstrapped():
                return True
            if isinstance(req.finished_reason, FINISH_ABORT):
                return False
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.ctx.rank}: {req.rid} still bootstrapping; {self._local_state(req)}")
            time.sleep(_POLL_S)

    def _wait_done(self, req: Any, deadline: float) -> int:
        """The CP-wide poll until the transfer ends (Success or Failed)."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        while (poll := self._poll(req)) not in (KVPoll.Success, KVPoll.Failed):
            if time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.ctx.rank}: {req.rid} still transferring; {self._local_state(req)}")
            time.sleep(_POLL_S)
        return poll

    def _close_sender(self, req: Any, out: PrefillOutcome, poll: int) -> None:
        """After the CP-wide poll: the sender cleared, or the recorded failure read."""
        from sglang.srt.disaggregation.base.conn import KVPoll

        out.success = poll == KVPoll.Success
        if out.success:
            req.disagg_kv_sender.clear()
            return
        try:
            req.disagg_kv_sender.failure_exception()
        except Exception as error:  # upstream raises the recorded reason
            out.failure = str(error)


class DecodeChecks:
    """A decode server of either line: receive a request through upstream's decode queues
    and check its bytes on the server's own pool.

    The line's class sets ``scenario``, ``ports``, ``errors`` (an :class:`ErrorLog`),
    ``prealloc_queue``, ``transfer_queue``, ``granted`` (pages ever granted), ``served``
    ((spec, locs) re-checked at the end), ``planted`` (the same, of planted requests: re-checked
    apart, so one cluster serves the negative controls beside the clean requests) and defines
    ``_new_req(spec)``, ``_locs(req, n)`` (the request's decode slots),
    ``_mismatches(spec, locs)`` ((target, draft) tokens),
    ``_aux_ok(spec, req)``, ``_release(req)`` (a checked request given back),
    ``_keep(spec, locs, req)`` (a checked request held for the final re-check) and
    ``_changed_pages()`` (per page, whether any byte left the sentinel).
    """

    page_size: int

    def serve(self, spec: PDRequest, keep: bool = True) -> DecodeOutcome:
        """Receive ``spec`` through upstream's queues; check its bytes on this pool.

        ``keep=False``: once checked, the request's KV pages and row go back (upstream's
        ``release_kv_cache``, as a request that finished decoding) and the end-of-run
        re-check skips it; its pages stay counted as granted for the sentinel check.
        """
        import torch
        from sglang.srt.managers.schedule_batch import FINISH_ABORT

        # Later than the prefill ranks' deadline: a stuck transfer is reported by the side
        # that knows why.
        deadline = time.monotonic() + self.scenario.transfer_timeout_s + 15
        out = DecodeOutcome(spec.rid, success=False)
        errors_before = len(self.errors.messages)
        req = self._new_req(spec)
        self.prealloc_queue.add(req)
        started, transferred, locs = time.monotonic(), False, None
        while not isinstance(req.finished_reason, FINISH_ABORT):
            preallocated = _first(self.prealloc_queue.pop_preallocated())
            self.transfer_queue.extend(preallocated)
            if preallocated:
                locs = self._locs(req, len(spec.token_ids)).to(torch.int64).clone()
                pages = (locs // self.page_size).unique()
                self.granted.update(pages.tolist())
                out.granted_pages = len(pages)
                started = time.monotonic()
            if req in _first(self.transfer_queue.pop_transferred()):
                transferred = True
                break
            if time.monotonic() > deadline:
                status = self.prealloc_queue.kv_manager.request_status.get(spec.room)
                raise TimeoutError(
                    f"decode: {spec.rid} not transferred in time "
                    f"(preallocated: {locs is not None}, receiver status {status})"
                )
            time.sleep(_POLL_S)
        out.transfer_s = time.monotonic() - started
        out.errors_logged = self.errors.messages[errors_before:]
        if not transferred:
            out.failure = str(req.finished_reason.message)
            if locs is not None:
                pages = (locs // self.page_size).unique().numpy()
                out.granted_pages_touched = int(self._changed_pages()[pages].sum())
            return out
        out.success = True
        out.kv_mismatches, out.draft_mismatches = self._mismatches(spec, locs)
        out.aux_ok = self._aux_ok(spec, req)
        if keep:
            self._keep(spec, locs, req)
        else:
            self._release(req)
        return out

    def report(self, outcomes: List[DecodeOutcome]) -> DecodeReport:
        """End of run: every kept request re-checked, and every page never granted still
        holds the sentinel."""
        final = [self._mismatches(spec, locs) for spec, locs in self.served]
        planted = [self._mismatches(spec, locs) for spec, locs in self.planted]
        changed = self._changed_pages()
        off_grant = [p for p in changed.nonzero()[0].tolist() if p not in self.granted]
        return DecodeReport(
            outcomes=outcomes,
            final_kv_mismatches=sum(t for t, _ in final),
            final_draft_mismatches=sum(d for _, d in final),
            off_grant_pages_changed=len(off_grant),
            final_planted_kv_mismatches=sum(t for t, _ in planted),
        )


def _first(popped: Any) -> Any:
    """Upstream's queue pops return a list, or (list, extra) on some releases."""
    return popped[0] if isinstance(popped, tuple) else popped


__all__ = [
    "DecodeChecks",
    "PrefillSteps",
    "load_plugins",
]
