"""Per-layer vs all-layer CP HiCache backup on the CPU runtime: submissions and scheduler time.

Runs the line of the installed SGLang (0.5.12.post1 in ``.venv``, 0.5.23 in
``.venv-sglang-0.5.23``).

**0.5.12 line.** One trace of prefill batches (each inserts ``--nodes`` new nodes with a random owner
pattern) runs twice on rank 0 of a CP group, over the real NSA pools and the
``CpHybridCacheController``:

* all-layer: after the forward, each node is reserved and submitted (``submit_write``),
  one all-layer D2H per node;
* per-layer: before the forward, each node is reserved and held (``per_layer=True``); the
  forward's layer hook calls ``backup_layer(l)`` for every layer (one merged D2H of all
  nodes per layer); after the forward only ``end_forward()`` runs.

Reported per batch: D2H submissions (calls of the host pool group's backup method) and
the scheduler thread's time in the post-forward path, plus (per-layer) the time spent in
the layer hooks inside the forward. On the CPU runtime every copy is synchronous, so the
post-forward figure of the all-layer path includes its copies: on a GPU those are async
launches, and the figure to compare there is the D2H overlap, not measured here.
No timing is asserted.

**0.5.23 line.** The same trace shape on every rank of a gloo CP group (``--cp-size``
ranks), over upstream's REAL sharded stack (``testing/v0_5_23/layer_backup_stack.py``), in
two modes measured in the same run: upstream's all-layer path (the plugin's flag off: the
insert allocates host slots and ``flush_pending_backups`` submits one all-layer D2H after
the forward) and the plugin's per-layer path (flag on: slots reserved before the forward,
each layer moved by the store hook, the insert only claims). Post-forward = the scheduler
thread's time in ``_execute_kv_backup`` and ``start_writing`` (the backup part of the
insert and the flush); printed as per-layer / all-layer (target <= 0.05), max over ranks.
As on 0.5.12, CPU copies are synchronous, so the all-layer figure includes its copies.
Both host layouts run, each with both modes: ``layer_first`` and ``page_first`` (0.5.23's
default; kernel I/O). After each batch's acks every rank compares its owned host rows and
indexer pages of every layer with the device's: the bytes mismatches (target 0) are summed
over batches and ranks per mode.

    PYTHONPATH=python .venv/bin/python benchmark/bench_per_layer_backup.py
    PYTHONPATH=python .venv-sglang-0.5.23/bin/python benchmark/bench_per_layer_backup.py --cp-size 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import List

import sglang_cp_hicache.testing

sglang_cp_hicache.testing.install()

import torch  # noqa: E402

from sglang_cp_hicache.core.releases import line_package  # noqa: E402

logger = logging.getLogger("bench_per_layer_backup")
#: The 0.5.23 line's host layouts, each measured with both modes.
LAYOUTS_0_5_23 = ("layer_first", "page_first")


@dataclass
class ModeFigures:
    """Per-batch figures of one mode over the whole trace."""

    submissions: List[int] = field(default_factory=list)
    post_forward_s: List[float] = field(default_factory=list)
    pre_forward_s: List[float] = field(default_factory=list)
    in_forward_s: List[float] = field(default_factory=list)


class SubmissionCounter:
    """Counts the host pool group's D2H calls (all-layer and per-layer), passing them on."""

    def __init__(self, controller) -> None:
        self.count = 0
        group, layer_backup = controller.mem_pool_host, controller.layer_backup
        self._wrap(group, "backup_from_device_all_layer")
        self._wrap(layer_backup, "backup_from_device_per_layer")

    def _wrap(self, obj, name: str) -> None:
        real = getattr(obj, name)

        def counted(*args, **kwargs):
            self.count += 1
            return real(*args, **kwargs)

        setattr(obj, name, counted)


def make_trace(args) -> List[List[List[int]]]:
    """Per batch, per node, the owner of each page (seeded: both modes see the same)."""
    gen = torch.Generator().manual_seed(args.seed)
    return [
        [torch.randint(0, args.cp_size, (args.pages,), generator=gen).tolist() for _ in range(args.nodes)]
        for _ in range(args.batches)
    ]


def run(mode: str, trace, args) -> ModeFigures:
    from sglang_cp_hicache.testing.dist import single_rank_world
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun

    cfg = nsa_stack.StackConfig(
        cp_size=args.cp_size,
        layer_num=args.layers,
        physical_tokens=args.page_size * (args.nodes * args.pages + 4),
        io_backend=args.io_backend,
        mem_layout=args.layout,
    )
    stack = nsa_stack.build_rank_stack(cfg, 0, None, single_rank_world())
    controller = stack.cache.cache_controller
    counter = SubmissionCounter(controller)
    figures = ModeFigures()
    for batch in trace:
        locs = [stack.allocator.alloc_pages_with_owners(torch.tensor(owners)) for owners in batch]
        for node_locs in locs:  # what the forward stores (outside the timed paths)
            positions = torch.arange(len(node_locs))
            nsa_stack.write_prefill_kv(stack, node_locs, positions + 7, positions)
        plans = [controller.host_table.plan_write(PageRun.of(l.numpy(), args.page_size)) for l in locs]
        before = counter.count
        pending = []
        in_forward = 0.0
        if mode == "per-layer":
            start = time.perf_counter()
            for node_id, plan in enumerate(plans):
                held = controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools())
                controller.submit_write(held, per_layer=True)
                pending.append(held)
            figures.pre_forward_s.append(time.perf_counter() - start)
            for layer in range(args.layers):  # the layer hooks, inside the forward
                start = time.perf_counter()
                controller.backup_layer(layer)
                in_forward += time.perf_counter() - start
            start = time.perf_counter()
            controller.end_forward()
            figures.post_forward_s.append(time.perf_counter() - start)
        else:
            start = time.perf_counter()
            for node_id, plan in enumerate(plans):
                written = controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools())
                controller.submit_write(written)
                pending.append(written)
            figures.post_forward_s.append(time.perf_counter() - start)
            figures.pre_forward_s.append(0.0)
        figures.in_forward_s.append(in_forward)
        figures.submissions.append(counter.count - before)
        # Commit, then drop the batch so the trace runs at constant occupancy.
        controller.ack_write_queue.clear()
        for written in pending:
            controller.rollback_write(written)
        for node_locs in locs:
            stack.allocator.free(node_locs)
    stack.close()
    return figures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cp-size", type=int, default=4)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--nodes", type=int, default=4, help="new nodes per prefill batch")
    parser.add_argument("--pages", type=int, default=8, help="pages per node")
    parser.add_argument("--page-size", type=int, default=64)
    parser.add_argument("--io-backend", default="direct", choices=("direct", "kernel"))
    parser.add_argument("--layout", default="layer_first", choices=("layer_first", "page_first_direct"))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    torch.set_num_threads(1)  # stable figures on shared boxes

    if line_package().endswith("v0_5_23"):
        main_0_5_23(args)
        return
    trace = make_trace(args)
    results = {mode: run(mode, trace, args) for mode in ("all-layer", "per-layer")}
    logger.info(
        "cp=%d rank=0 layers=%d batches=%d nodes/batch=%d pages/node=%d io=%s layout=%s",
        args.cp_size, args.layers, args.batches, args.nodes, args.pages, args.io_backend, args.layout,
    )
    for mode, fig in results.items():
        logger.info(
            "%-9s D2H submissions/batch %.1f | scheduler ms/batch: pre-forward %.3f, "
            "in-forward hooks %.3f, post-forward %.3f",
            mode,
            statistics.mean(fig.submissions),
            statistics.median(fig.pre_forward_s) * 1e3,
            statistics.median(fig.in_forward_s) * 1e3,
            statistics.median(fig.post_forward_s) * 1e3,
        )
    all_layer, per_layer = results["all-layer"], results["per-layer"]
    ratio = statistics.median(per_layer.post_forward_s) / statistics.median(all_layer.post_forward_s)
    total = [
        sum(statistics.median(getattr(fig, name)) for name in ("pre_forward_s", "in_forward_s", "post_forward_s"))
        for fig in (all_layer, per_layer)
    ]
    logger.info("post-forward time per-layer / all-layer: %.2e", ratio)
    logger.info("total scheduler-thread backup time per-layer / all-layer: %.2f", total[1] / total[0])


def main_0_5_23(args) -> None:
    """Both modes on ``--cp-size`` gloo ranks of upstream's sharded stack; rank figures
    are per-batch medians, the ratio is taken on the slowest rank of each mode."""
    from sglang_cp_hicache.testing.dist import run_ranks
    from sglang_cp_hicache.testing.v0_5_23.layer_backup_stack import time_backups

    logger.info(
        "sglang 0.5.23 cp=%d layers=%d batches=%d nodes/batch=%d pages/node=%d (kernel I/O)",
        args.cp_size, args.layers, args.batches, args.nodes, args.pages,
    )
    modes = {"all-layer": False, "per-layer": True}
    for layout in LAYOUTS_0_5_23:
        bench = dict(
            layers=args.layers, batches=args.batches, nodes=args.nodes, pages=args.pages, seed=args.seed, layout=layout
        )
        worst, mismatches = {}, {}
        for mode, per_layer in modes.items():
            ranks = run_ranks(args.cp_size, time_backups, per_layer, bench, timeout_s=1800)
            medians = [
                {name: statistics.median(getattr(t, name)) for name in ("pre_forward_s", "in_forward_s", "post_forward_s")}
                for t in ranks
            ]
            worst[mode] = {name: max(m[name] for m in medians) for name in medians[0]}
            mismatches[mode] = sum(sum(t.host_mismatches) for t in ranks)
            logger.info(
                "%-11s %-9s scheduler ms/batch (max over ranks): pre-forward %.3f, in-forward hooks %.3f, "
                "post-forward %.3f; bytes mismatches %d",
                layout, mode, worst[mode]["pre_forward_s"] * 1e3, worst[mode]["in_forward_s"] * 1e3,
                worst[mode]["post_forward_s"] * 1e3, mismatches[mode],
            )
        ratio = worst["per-layer"]["post_forward_s"] / worst["all-layer"]["post_forward_s"]
        total = [sum(worst[mode].values()) for mode in modes]
        logger.info(
            "%-11s post-forward time per-layer / all-layer: %.2e (target <= 0.05); total scheduler-thread backup "
            "time per-layer / all-layer: %.2f; bytes mismatches per-layer %d, all-layer %d (target 0)",
            layout, ratio, total[1] / total[0], mismatches["per-layer"], mismatches["all-layer"],
        )


if __name__ == "__main__":
    main()
