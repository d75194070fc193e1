"""Serving scenarios with EAGLE (the checkpoint's NextN layer as the draft) on both sides of
the comparison: an EAGLE decode server and two EAGLE prefills of the session's TP size, the
sharded one (the plugin's flag, HiCache) and its unsharded reference, each behind its own
router, started for the scenario and retired after it (the main cluster runs no EAGLE).

Each request's answer is compared with the reference's as every scenario does (output ids
equal, logprobs bit for bit); the accept figures SGLang reports per request
(``meta_info``'s ``spec_verify_ct``, ``spec_accept_length``) are checked present (a decode
that verified nothing ran no EAGLE) and reported.
"""

from __future__ import annotations

import logging
from typing import List, Optional

from sglang_cp_hicache.testing.server.client import Completion
from sglang_cp_hicache.testing.server.cluster import Router, Server
from sglang_cp_hicache.testing.server.launch import PAGE_SIZE, PrefillSpec
from sglang_cp_hicache.testing.server.recorder import Recorder, ScenarioReport, full_pages, tokens
from sglang_cp_hicache.testing.server.session import ServingSession

logger = logging.getLogger(__name__)

EAGLE_MAX_NEW = 12  # enough verify steps for an accept length to mean something


def _accept_figures(rec: Recorder, label: str, completion: Optional[Completion]) -> None:
    if completion is None:
        return
    verify_ct = completion.spec.get("spec_verify_ct", 0.0)
    rec.expect(verify_ct > 0, f"{label}: no EAGLE verify reported (meta_info spec fields {completion.spec})")
    if verify_ct > 0:
        rec.note(
            f"{label}: {verify_ct:.0f} verify steps for {len(completion.output_ids)} tokens, accept length "
            f"{completion.spec.get('spec_accept_length', 0.0):.2f}, accept rate {completion.spec.get('spec_accept_rate', 0.0):.2f}"
        )


def _device_prefix_hit(rec: Recorder) -> None:
    prompt = tokens("eagle:device", 6 * PAGE_SIZE + 10)
    for label, ids, cold in (("cold", prompt, True), ("extended", prompt + tokens("eagle:device:more", 40), False)):
        a, b = rec.pair(label, ids, max_new=EAGLE_MAX_NEW, cold=cold)
        _accept_figures(rec, f"{label}, sharded", a)
        _accept_figures(rec, f"{label}, reference", b)
        if not cold and a is not None:
            want = full_pages(len(prompt))
            rec.expect(a.tier("device") >= want, f"device hit {a.cached_by_tier}, want >= {want}")


def eagle(session: ServingSession) -> ScenarioReport:
    """EAGLE on the sharded prefill, its reference and their decode: a prompt, then the same
    prompt extended (its full pages a device hit), answers identical to the reference's."""
    cluster = session.cluster
    args = tuple(session.line.eagle_args())
    decode = cluster.decode("decode-eagle", args)
    prefills: List[Server] = [
        cluster.prefill(PrefillSpec("sharded-eagle", tp=session.tp, extra_args=args)),
        cluster.prefill(PrefillSpec("reference-eagle", tp=session.tp, sharded=False, extra_args=args)),
    ]
    routers: List[Router] = []
    try:
        times = cluster.start(decode, *prefills)
        routers = [cluster.router(f"router-{p.name}", p, decode) for p in prefills]
        times.update(cluster.start(*routers))
        rec = Recorder(session, "EAGLE: device prefix hit", sharded=routers[0], reference=routers[1])
        rec.note("EAGLE servers started in " + ", ".join(f"{name} {s:.0f} s" for name, s in times.items()))
        _device_prefix_hit(rec)
        return rec.finish()
    finally:
        session.retire(*routers, *prefills, decode)


__all__ = ["EAGLE_MAX_NEW", "eagle"]
