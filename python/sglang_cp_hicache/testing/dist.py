"""Gloo process groups for N simulated CP ranks.

Under NSA prefill CP, SGLang forces DP attention with attention-TP size 1, so each scheduler
rank builds its cache with ``tp_cache_group`` = its own single-rank attention-TP group and
``attn_cp_cache_group`` = the CP group of all ranks. :func:`run_ranks` reproduces exactly that
on CPU: one process per rank, gloo groups, the CPU runtime installed before SGLang loads.

Processes start from a forkserver that imports SGLang once (about 8 s on 2 cores); every
later launch then forks from it in well under a second.
"""

from __future__ import annotations

import datetime
import importlib
import importlib.util
import multiprocessing as mp
import os
import queue as queue_module
import socket
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any, Callable, List, Optional

_PRELOAD = "sglang_cp_hicache.testing._preload"
_POLL_S = 0.5  # how often run_ranks checks for ranks that died without reporting
_BEAT_EVERY_S = 1.0  # a rank's heartbeats are thinned to one per second
_context: Optional[mp.context.BaseContext] = None


@dataclass
class _Beats:
    """A run_ranks child's progress channel (None in every other process)."""

    rank: int
    queue: Any
    last_s: float = 0.0


_beats: Optional[_Beats] = None


@dataclass
class RankContext:
    """What one simulated scheduler rank receives."""

    rank: int
    world_size: int
    cp_group: Any  # torch.distributed ProcessGroup over all ranks (attention CP)
    attn_tp_group: Any  # this rank's single-rank attention-TP group


class RankFailed(RuntimeError):
    """A rank raised; carries that rank's traceback."""


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _get_context() -> mp.context.BaseContext:
    global _context
    if _context is None:
        _context = mp.get_context("forkserver")
        _context.set_forkserver_preload([_PRELOAD])
    return _context


def init_rank_groups(rank: int, world_size: int, port: int, timeout_s: float) -> RankContext:
    """Join the gloo world and build the CP and per-rank attention-TP groups."""
    import torch.distributed as dist

    dist.init_process_group(
        backend="gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=timeout_s),
    )
    cp_group = dist.new_group(list(range(world_size)), backend="gloo")
    attn_tp_group = None
    for r in range(world_size):  # every rank must take part in creating every group
        group = dist.new_group([r], backend="gloo")
        if r == rank:
            attn_tp_group = group
    return RankContext(rank, world_size, cp_group, attn_tp_group)


def single_rank_world() -> Any:
    """This process as a one-rank gloo world (created once); returns its WORLD group.

    For single-process tests and benchmarks that build rank ``r`` of a larger CP layout:
    HiRadixCache asks its TP group for a world size, but its decisions need no peers.
    """
    import torch.distributed as dist

    if not dist.is_initialized():
        # An in-memory store: no file or port to leave behind when the process ends.
        dist.init_process_group(
            "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            timeout=datetime.timedelta(seconds=60),
        )
    return dist.group.WORLD


def _function_ref(fn: Callable[..., Any]) -> tuple[str, str, str]:
    """(module, file, qualname): pytest test modules are not importable by name in a child."""
    module = sys.modules[fn.__module__]
    return fn.__module__, getattr(module, "__file__", "") or "", fn.__qualname__


def _resolve_function(ref: tuple[str, str, str]) -> Callable[..., Any]:
    module_name, file, qualname = ref
    try:
        module = importlib.import_module(module_name)
    except ImportError:
        spec = importlib.util.spec_from_file_location(module_name, file)
        module = importlib.util.module_from_spec(spec)
        sys.modules[module_name] = module
        spec.loader.exec_module(module)
    obj: Any = module
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def heartbeat() -> None:
    """Tell :func:`run_ranks` this rank is making progress, so its ``timeout_s`` counts
    from now. A no-op outside a ``run_ranks`` child (the harness, a PD role)."""
    if _beats is None:
        return
    now = time.monotonic()
    if now - _beats.last_s >= _BEAT_EVERY_S:
        _beats.last_s = now
        _beats.queue.put((_beats.rank, None, None))


def _child(rank: int, world_size: int, port: int, timeout_s: float, fn_ref, args, queue) -> None:
    from sglang_cp_hicache.testing import install

    global _beats
    _beats = _Beats(rank, queue)
    install()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        fn = _resolve_function(fn_ref)
        ctx = init_rank_groups(rank, world_size, port, timeout_s)
        result = fn(ctx, *args)
        queue.put((rank, True, result))
    except BaseException:  # report every failure, including assertion errors
        queue.put((rank, False, traceback.format_exc()))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _collect(procs, queue, timeout_s: float, results: dict, failures: list) -> None:
    """Gather every rank's report; stop at the first failure, at a rank that exited
    without reporting (killed, ``os._exit``, a crash outside Python), or when no rank
    reported or beat (:func:`heartbeat`) for ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    silent_polls = 0
    while len(results) < len(procs):
        try:
            rank, ok, payload = queue.get(timeout=_POLL_S)
        except queue_module.Empty:
            # A rank's report is flushed before its process exits, so an exited rank
            # without a report after two empty polls never sent one.
            exited = [r for r, p in enumerate(procs) if p.exitcode is not None and r not in results]
            silent_polls = silent_polls + 1 if exited else 0
            if silent_polls >= 2:
                rank = exited[0]
                failures.append(
                    f"rank {rank}: exited with code {procs[rank].exitcode} without reporting"
                )
                return
            if time.monotonic() > deadline:
                silent = sorted(set(range(len(procs))) - set(results))
                failures.append(f"no report from ranks {silent} within {timeout_s:.0f} s")
                return
            continue
        if ok is None:  # a heartbeat
            deadline = time.monotonic() + timeout_s
            continue
        if not ok:
            failures.append(f"rank {rank}:\n{payload}")
            return
        results[rank] = payload


def run_ranks(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout_s: float = 180.0,
) -> List[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` gloo ranks; return results in rank order.

    ``fn`` must be importable (module-level) and its result picklable. Raises
    :class:`RankFailed` with the first failing rank's traceback, or naming a rank that
    exited without reporting, or the ranks still silent after ``timeout_s`` (no report
    and no :func:`heartbeat`; ``timeout_s`` is also the gloo groups' timeout).
    """
    ctx = _get_context()
    queue = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(
            target=_child,
            args=(r, world_size, port, timeout_s, _function_ref(fn), args, queue),
        )
        for r in range(world_size)
    ]
    for proc in procs:
        proc.start()
    results: dict[int, Any] = {}
    failures: list[str] = []
    try:
        _collect(procs, queue, timeout_s, results, failures)
    finally:
        # One grace period for all ranks, not one each: a failed run of N ranks
        # still stuck in their work is ended after 5 s, not 5 N.
        join_by = time.monotonic() + (5 if failures else timeout_s)
        for proc in procs:
            proc.join(timeout=max(0.0, join_by - time.monotonic()))
            if proc.is_alive():
                proc.kill()
                proc.join()
    if failures:
        raise RankFailed("\n".join(failures))
    return [results[r] for r in range(world_size)]
