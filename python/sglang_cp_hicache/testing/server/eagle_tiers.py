"""EAGLE through every tier a hit can come from: host load-back, the L3 file tier, the
Mooncake store and chunked prefill, on one set of EAGLE servers of the checkpoint whose
drafts get accepted (``tiny_model.MIRRORED_DRAFT``): an EAGLE decode, the sharded prefill on
a file tier, a sharded prefill on the Mooncake store (``page_first``) and the unsharded
reference on a file tier of its own, each prefill behind its own router.

Every request is compared with the reference's (output ids equal, logprobs bit for bit), and
so are its drafts: the decode proposes from the draft KV the prefill computed or loaded
back, so a hit whose draft pages came back wrong (or not at all) accepts other drafts than
the reference's over the same tokens. The draft's L3 bytes are read back: every page a hit
reads has, in the file tier and in the store, objects holding the draft's layers, not all
zero and byte for byte the reference's (``draft_bytes.py``); the L3 objects are written
from the host pool, so they are the draft's host rows too.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Sequence, Set

from sglang_cp_hicache.testing.server.client import Completion
from sglang_cp_hicache.testing.server.cluster import MooncakeMaster, Router, Server, ServingCluster
from sglang_cp_hicache.testing.server.draft_bytes import PageGeometry, check_draft_bytes, file_keys, file_objects, geometry_of
from sglang_cp_hicache.testing.server.eagle_scenario import EAGLE_MAX_NEW
from sglang_cp_hicache.testing.server.launch import CHUNKED_PREFILL_SIZE, LOGICAL_TOKENS, PAGE_SIZE, PrefillSpec, StorageSpec
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, flush, full_pages, tokens, wait_settled
from sglang_cp_hicache.testing.server.session import ServingSession
from sglang_cp_hicache.testing.server.store_view import StoreView, page_of
from sglang_cp_hicache.testing.server.tiny_model import MIRRORED_DRAFT, ensure_checkpoint

logger = logging.getLogger(__name__)

MIN_ACCEPT_RATE = 0.25  # below it the drafts' comparison has no power (the random draft: 0.09)


class DraftLedger:
    """Each pair's drafts compared (the sharded side's accepted and verified counts against
    the reference's) and the sharded side's totals."""

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.correct = 0.0
        self.proposed = 0.0

    def pair(self, label: str, ids: Sequence[int], max_new: int = EAGLE_MAX_NEW, cold: bool = False):
        a, b = self.rec.pair(label, ids, max_new=max_new, cold=cold)
        if a is not None and b is not None:
            self.compare(label, a, b)
        return a, b

    def compare(self, label: str, a: Completion, b: Completion) -> None:
        ours = (a.spec.get("spec_verify_ct", 0.0), a.spec.get("spec_num_correct_drafts", -1.0))
        theirs = (b.spec.get("spec_verify_ct", 0.0), b.spec.get("spec_num_correct_drafts", -1.0))
        self.rec.expect(ours[0] > 0, f"{label}: no EAGLE verify reported ({a.spec})")
        self.rec.expect(
            ours == theirs,
            f"{label}: the sharded side accepted {ours[1]:.0f} drafts in {ours[0]:.0f} verifies, the reference "
            f"{theirs[1]:.0f} in {theirs[0]:.0f} (their draft KV differs)",
        )
        self.correct += a.spec.get("spec_num_correct_drafts", 0.0)
        self.proposed += a.spec.get("spec_num_proposed_drafts", 0.0)
        self.rec.note(f"{label}: accept length {a.spec.get('spec_accept_length', 0.0):.2f} "
                      f"(reference {b.spec.get('spec_accept_length', 0.0):.2f})")  # fmt: skip

    def finish(self) -> None:
        rate = self.correct / self.proposed if self.proposed else 0.0
        self.rec.note(f"sharded side: {self.correct:.0f} of {self.proposed:.0f} drafts accepted (rate {rate:.2f})")
        self.rec.expect(rate >= MIN_ACCEPT_RATE, f"accept rate {rate:.2f} < {MIN_ACCEPT_RATE}: the drafts' comparison shows nothing")


def cached_len(prompt: Sequence[int]) -> int:
    """The tokens of ``prompt`` an EAGLE server caches: the full pages of its radix key, a
    bigram key one shorter than the prompt (upstream's ``RadixKey(is_bigram=True)``)."""
    return full_pages(len(prompt) - 1)


def _new_keys(keys: Callable[[], Set[str]], before: Set[str]) -> Set[str]:
    wait_settled(lambda: len(keys() - before), 1)
    return keys() - before


def _chunked(ledger: DraftLedger) -> None:
    prompt = tokens("eagle-tiers:chunked", 2 * CHUNKED_PREFILL_SIZE + 3 * PAGE_SIZE + 17)
    ledger.pair("chunked: cold", prompt, cold=True)
    a, _ = ledger.pair("chunked: extended", prompt + tokens("eagle-tiers:chunked:more", CHUNKED_PREFILL_SIZE + 5))
    if a is not None:
        ledger.rec.expect(a.tier("device") > CHUNKED_PREFILL_SIZE, f"chunked: device hit {a.cached_by_tier} <= one chunk")


def _host_load_back(ledger: DraftLedger) -> None:
    prompt = tokens("eagle-tiers:host", 12 * PAGE_SIZE)
    ledger.pair("host: cold", prompt, cold=True)
    filler_tokens = 25 * PAGE_SIZE
    for i in range(LOGICAL_TOKENS // filler_tokens + 1):
        ledger.rec.pair(f"host: filler {i}", tokens(f"eagle-tiers:host:filler:{i}", filler_tokens))
    a, b = ledger.pair("host: revisit", prompt + tokens("eagle-tiers:host:more", 30))
    if a is not None and b is not None:
        want = cached_len(prompt)
        ledger.rec.expect(a.tier("host") > 0 and a.tier("host") + a.tier("device") >= want, f"host: sharded hit {a.cached_by_tier}, want {want} with host")
        ledger.rec.expect(a.cached_by_tier == b.cached_by_tier, f"host: hits {a.cached_by_tier} != reference {b.cached_by_tier}")


class EagleTiers:
    """The scenario's servers and the reference's L3 objects (read per check)."""

    def __init__(self, session: ServingSession, cluster: ServingCluster, master: MooncakeMaster):
        self.session = session
        self.cluster = cluster
        self.master = master
        run_dir = session.cluster.run_dir / "eagle-tiers"
        self.file_tier = StorageSpec("file", directory=run_dir / "l3-file")
        self.reference_tier = StorageSpec("file", directory=run_dir / "l3-file-reference")
        self.geometry: PageGeometry = geometry_of(MIRRORED_DRAFT, PAGE_SIZE)
        args = tuple(session.line.eagle_args())
        self.decode = cluster.decode("decode-eagle-tiers", args)
        self.prefills: List[Server] = [
            cluster.prefill(PrefillSpec("sharded-eagle-file", tp=session.tp, storage=self.file_tier, extra_args=args)),
            cluster.prefill(PrefillSpec("sharded-eagle-mooncake", tp=session.tp, mem_layout="page_first",
                                        storage=StorageSpec("mooncake", mooncake_master=master.address), extra_args=args)),
            cluster.prefill(PrefillSpec("reference-eagle-file", tp=session.tp, sharded=False, storage=self.reference_tier, extra_args=args)),
        ]  # fmt: skip
        self.routers: List[Router] = []

    def start(self) -> Dict[str, float]:
        times = self.cluster.start(self.decode, *self.prefills)
        self.routers = [self.cluster.router(f"router-{p.name}", p, self.decode) for p in self.prefills]
        times.update(self.cluster.start(*self.routers))
        return times

    def l3_file(self, ledger: DraftLedger) -> None:
        rec, sharded = ledger.rec, self.prefills[0]
        before = file_keys(self.file_tier.directory), file_keys(self.reference_tier.directory)
        prompt = tokens("eagle-tiers:l3file", 10 * PAGE_SIZE)
        ledger.pair("L3 file: cold", prompt, cold=True)
        pages = {page_of(k) for k in _new_keys(lambda: file_keys(self.file_tier.directory), before[0])}
        _new_keys(lambda: file_keys(self.reference_tier.directory), before[1])
        self._check_bytes(rec, "L3 file", file_objects(self.file_tier.directory), pages, prompt, token_major=False)
        self._storage_hit(ledger, sharded, prompt, "L3 file")

    def l3_mooncake(self, ledger: DraftLedger) -> None:
        rec = ledger.rec
        store = StoreView(self.master)
        try:
            before, reference_before = store.keys(), file_keys(self.reference_tier.directory)
            prompt = tokens("eagle-tiers:mooncake", 10 * PAGE_SIZE)
            ledger.pair("Mooncake: cold", prompt, cold=True)
            keys = _new_keys(store.keys, before)
            _new_keys(lambda: file_keys(self.reference_tier.directory), reference_before)
            pages = {page_of(k) for k in keys}
            self._check_bytes(rec, "Mooncake", store.read(keys), pages, prompt, token_major=True)
        finally:
            store.close()
        self._storage_hit(ledger, self.prefills[1], prompt, "Mooncake")

    def _check_bytes(self, rec: Recorder, label: str, objects, pages: Set[str], prompt: Sequence[int], token_major: bool) -> None:
        want = cached_len(prompt) // PAGE_SIZE
        rec.expect(len(pages) == want, f"{label}: objects of {len(pages)} new pages, want the prompt's {want}")
        check = check_draft_bytes(objects, file_objects(self.reference_tier.directory), pages, self.geometry, token_major)
        for problem in check.problems:
            rec.expect(False, f"{label}: {problem}")
        rec.note(f"{label}: {check.objects} objects of {check.pages} pages read back, each with the draft's "
                 f"{self.geometry.draft_layers} layer(s) of {self.geometry.layers}: "
                 + ("draft and target bytes equal the reference's" if not check.problems else f"{len(check.problems)} problems"))  # fmt: skip

    @staticmethod
    def _storage_hit(ledger: DraftLedger, prefill: Server, prompt: List[int], label: str) -> None:
        rec = ledger.rec
        rec.expect(flush(prefill), f"/flush_cache failed on {prefill.name}")
        a, b = ledger.pair(f"{label}: after flush", prompt + tokens(f"eagle-tiers:{label}:more", 25))
        if a is not None and b is not None:
            want = cached_len(prompt)
            rec.expect(a.tier("storage") >= want, f"{label}: storage hit {a.cached_by_tier}, want {want}")
            rec.expect(b.tier("device") >= want, f"{label}: reference device hit {b.cached_by_tier}, want {want}")


def eagle_tiers(session: ServingSession) -> ScenarioReport:
    """Host load-back, L3 file and Mooncake storage hits and chunked prefill with EAGLE on the
    sharded prefills and their reference: answers and drafts identical, the draft's L3 bytes
    read back for every hit page."""
    cluster = session.cluster.serving(ensure_checkpoint(MIRRORED_DRAFT, session.cluster.model.parent))
    master = cluster.mooncake_master("mooncake-master-eagle-tiers")
    servers = EagleTiers(session, cluster, master)
    try:
        times = servers.start()
        file_router, mooncake_router, reference_router = servers.routers
        rec = Recorder(session, "EAGLE: host, L3 file, Mooncake, chunked", sharded=file_router, reference=reference_router)
        rec.note("EAGLE servers started in " + ", ".join(f"{name} {s:.0f} s" for name, s in times.items()))
        ledger = DraftLedger(rec)
        _chunked(ledger)
        servers.l3_file(ledger)
        _host_load_back(ledger)
        rec.sharded = mooncake_router
        servers.l3_mooncake(ledger)
        rec.sharded = file_router
        ledger.finish()
        return rec.finish()
    finally:
        session.retire(*servers.routers, *servers.prefills, servers.decode, master.process)


__all__ = ["DraftLedger", "EagleTiers", "MIN_ACCEPT_RATE", "cached_len", "eagle_tiers"]
