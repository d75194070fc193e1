"""A line's PD cluster run end to end: the roles of its :class:`PDLine` adapter
(``<line>.pd_harness.line.LINE``) started in order (bootstrap server, prefill ranks, decodes),
registration awaited, results gathered (:func:`run_pd_cluster`, :func:`run_fault_cluster`,
:func:`prefill_startup_failure`)."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from sglang_cp_hicache.testing.dist import _function_ref, _resolve_function
from sglang_cp_hicache.testing.pd.roles import (
    GO,
    LOOPBACK,
    PDCluster,
    PDEnv,
    REGISTERED,
    RoleChannel,
    RoleFailed,
    wait_prefill_registered,
)


#: How long a holding prefill role waits for :data:`GO`: a loaded box can take that long to
#: start the decodes the harness waits for first (their lifetime ends the role anyway).
_GO_WAIT_S = 180.0


def hold_if_asked(channel: RoleChannel, scenario: Any) -> None:
    """A prefill role, right after :data:`REGISTERED`: with ``scenario.hold_after_registering``
    wait for the harness's :data:`GO` before the first request."""
    if scenario.hold_after_registering:
        channel.wait(GO, timeout_s=_GO_WAIT_S)


#: How long the bootstrap server may take, once every prefill rank reported
#: :data:`REGISTERED`, to list the prefill as registered (each rank's PUT already returned).
REGISTRATION_VISIBLE_S = 10.0


def wait_registered(cluster: "PDCluster", names: List[str], timeout_s: float) -> None:
    """Block until every named prefill role reported :data:`REGISTERED` and the cluster's
    bootstrap server lists the prefill as registered; a prefill that reports but never
    registered fails here, naming the bootstrap server, not as a decode's long wait."""
    for name in names:
        cluster.roles[name].wait_event(REGISTERED, timeout_s)
    wait_prefill_registered(LOOPBACK, cluster.ports.bootstrap, REGISTRATION_VISIBLE_S)


@dataclass(frozen=True)
class PDLine:
    """One SGLang line's PD roles, the adapter the line-agnostic cluster runners take:
    ``prefill_role(channel, rank, scenario, ports)`` serves ``scenario`` as CP rank
    ``rank`` (reporting :data:`REGISTERED` once its KV manager registered) and returns its
    outcomes; ``decode_role(channel, scenario, ports, rids=None)`` serves the scenario's
    requests (or only ``rids``) and returns its report. Both module-level (they run in
    role processes)."""

    prefill_role: Callable[..., Any]
    decode_role: Callable[..., Any]


def prefill_names(cp_size: int) -> List[str]:
    """The prefill roles' names in a cluster of ``cp_size`` ranks."""
    return [f"prefill{r}" for r in range(cp_size)]


def run_pd_cluster(
    line: PDLine,
    scenario: Any,
    timeout_s: float = 150.0,
) -> Dict[str, Any]:
    """Run ``scenario`` on one cluster of ``line``'s roles (bootstrap, ``cp_size`` prefill
    ranks, one decode), every process ended on return. Returns each role's result by name
    (``prefill<r>``: the rank's outcomes; ``decode``: the decode's report), ``all_ended``
    and ``wall_s``."""
    start = time.monotonic()
    names = prefill_names(scenario.cp_size)
    with PDCluster() as cluster:
        cluster.start_bootstrap()
        for rank, name in enumerate(names):
            cluster.start(name, line.prefill_role, rank, scenario, cluster.ports)
        wait_registered(cluster, names, timeout_s)
        cluster.start("decode", line.decode_role, scenario, cluster.ports)
        results = cluster.results(names + ["decode"], timeout_s)
    results["all_ended"] = all(r.process.exitcode is not None for r in cluster.roles.values())
    results["wall_s"] = time.monotonic() - start
    return results


def _with_registration_wait(channel: RoleChannel, wait_s: float, role_ref: Tuple[str, str, str], *args: Any) -> Any:
    """Role: ``role_ref``'s role with the plugin's bootstrap registration bound set to ``wait_s``."""
    from sglang_cp_hicache.core import bootstrap_probe

    bootstrap_probe.REGISTRATION_WAIT_S = wait_s  # read at each registration
    return _resolve_function(role_ref)(channel, *args)


def prefill_startup_failure(line: PDLine, scenario: Any, timeout_s: float, registration_wait_s: float) -> str:
    """Start ``scenario.cp_size`` ranks of ``line``'s prefill role against a bootstrap
    address nobody serves (the cluster starts no bootstrap server), each rank waiting
    ``registration_wait_s`` for it (the plugin's bound, 10 s when served; a test needs no
    more than a few), and return the first rank's failure (its traceback); raise
    AssertionError if every rank started and served."""
    names = prefill_names(scenario.cp_size)
    role_ref = _function_ref(line.prefill_role)
    with PDCluster() as cluster:
        for rank, name in enumerate(names):
            cluster.start(
                name, _with_registration_wait, registration_wait_s, role_ref, rank, scenario, cluster.ports
            )
        try:
            cluster.results(names, timeout_s)
        except RoleFailed as failed:
            return str(failed)
    raise AssertionError(f"the prefill ranks started with bootstrap port {cluster.ports.bootstrap} unserved")


def run_fault_cluster(
    line: PDLine,
    scenario: Any,
    rids: Tuple[str, str, str],
    prefill_env: PDEnv,
    no_env_decode: PDEnv,
    timeout_s: float,
) -> Dict[str, Any]:
    """The fault cluster of ``line``'s roles, at ``scenario.cp_size``: ``rids`` = (killed,
    no-env, next). decode-a serves the killed request and dies once its first chunk went
    out (the prefill ranks wait at their ``chunk-sent`` checkpoint meanwhile); decode-b,
    started with ``no_env_decode``, serves no-env; decode-c serves next. The prefill ranks
    hold after registering until decode-a and decode-c are up, so ``prefill_env``'s
    bootstrap timeout bounds the metadata's way only, not a decode's start. Every role's
    result by name (not decode-a's), and ``all_ended``."""
    killed, no_env, following = rids
    prefills = prefill_names(scenario.cp_size)
    scenario = dataclasses.replace(scenario, hold_after_registering=True)
    with PDCluster() as cluster:
        cluster.start_bootstrap()
        for rank, name in enumerate(prefills):
            cluster.start(name, line.prefill_role, rank, scenario, cluster.ports, env=prefill_env)
        wait_registered(cluster, prefills, timeout_s)
        for name, rid in (("decode-a", killed), ("decode-c", following)):
            cluster.start(name, line.decode_role, scenario, cluster.ports, [rid])
        for name in ("decode-a", "decode-c"):
            cluster.roles[name].wait_event("ready", timeout_s)
        for name in prefills:
            cluster.roles[name].reply(GO)
        for name in prefills:
            cluster.roles[name].wait_event("chunk-sent", timeout_s)
        cluster.kill("decode-a")
        decode_b = cluster.start("decode-b", line.decode_role, scenario, cluster.ports, [no_env], env=no_env_decode)
        decode_b.wait_event("ready", timeout_s)
        for name in prefills:
            cluster.roles[name].reply("chunk-sent")
        results = cluster.results(prefills + ["decode-b", "decode-c"], timeout_s)
    results["all_ended"] = all(r.process.exitcode is not None for r in cluster.roles.values())
    return results



def decode_killed_problems(run: Dict[str, Any], rids: Tuple[str, str, str], cp_size: int) -> List[str]:
    """What a :func:`run_fault_cluster` run breaks of the decode-killed contract, one line
    each (none: it held): every prefill rank fails the killed request (room 401) within
    10 s of its first chunk naming it, frees it and leaves its pools unchanged, then serves
    the next request without a leak; decode-c receives that one byte-exact (KV, draft,
    aux) and no page outside its grant changes."""
    killed, _, following = rids
    problems: List[str] = []
    for name in prefill_names(cp_size):
        outcomes = {o.rid: o for o in run[name]}
        lost, served = outcomes[killed], outcomes[following]
        if lost.success or "Failed to send kv chunk of 401" not in (lost.failure or ""):
            problems.append(f"{name}: the killed request did not fail as a lost decode: {lost.failure!r}")
        if not lost.failure_detected_s < 10.0:  # the rest of its chunks, then Failed
            problems.append(f"{name}: the failure took {lost.failure_detected_s} s")
        if lost.leaked != [] or not lost.pools_unchanged:
            problems.append(f"{name}: the killed request leaked {lost.leaked} or changed the pools")
        if not served.success or served.leaked != []:
            problems.append(f"{name}: the next request failed or leaked {served.leaked}")
    received = {o.rid: o for o in run["decode-c"].outcomes}[following]
    if not (received.success and (received.kv_mismatches, received.draft_mismatches) == (0, 0) and received.aux_ok):
        problems.append(f"decode-c: the next request did not land byte-exact: {received}")
    if run["decode-c"].off_grant_pages_changed:
        problems.append(f"decode-c: {run['decode-c'].off_grant_pages_changed} pages outside the grant changed")
    return problems


__all__ = [
    "decode_killed_problems",
    "PDLine",
    "hold_if_asked",
    "prefill_names",
    "prefill_startup_failure",
    "run_fault_cluster",
    "run_pd_cluster",
    "wait_registered",
]
