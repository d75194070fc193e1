"""One rank's per-layer HiCache backup round trip on the real CP stack (0.5.12.post1 line).

The scenario of the multi-rank test (CPU runtime) and of the offline device check (CUDA:
SGLang's real kernels, streams and events): host pages reserved before a forward, each
layer's owned pages submitted on the write stream right after that layer's stores, an
all-layer backup submitted mid-forward, one ack per batch after the last layer on every
rank (a rank owning none of a node too), then a device wipe and a load-back checked layer
by layer against the KV pattern.

Nodes (page owners identical on every rank; ``last`` is the last CP rank):

* 11: pages on every rank, backed up layer by layer;
* 12: pages on ``last`` only, layer by layer (every other rank acks without a transfer);
* 13: stored before the forward, backed up all layers at once at layer 1.

The forward stores each layer of 11 and 12 right before reporting it, after a stall on
the forward's stream (``stall_cycles``; CUDA only), with device work only in between: a
write stream that did not wait for the layer's stores would copy the bytes from before
them (zeros), and the load-back would show it.
On CUDA the report also times the overlap: how long before the last layer's stores the
write stream had finished layer 0's copy.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import torch

from sglang_cp_hicache.core.rotation import owner_of
from sglang_cp_hicache.testing.forward_timing import ForwardTiming

PAGE_SIZE = 64
LAYERS = 3
PER_LAYER_NODES = (11, 12)
ALL_LAYER_NODE = 13


def node_owners(cp_size: int) -> Dict[int, List[int]]:
    """Node id -> the owner of each of its pages (identical on every rank)."""
    last = cp_size - 1
    return {
        11: [owner_of(0, p, cp_size) for p in range(5)],  # a chain from lane 0
        12: [last, last],  # every other rank owns nothing of it
        13: [0, last, 0],
    }


def per_layer_round_trip(
    ctx: Any,
    io_backend: str,
    layout: str,
    device: str = "cpu",
    stall_cycles: int = 0,
    keep_stacks: Optional[List[Any]] = None,
) -> Dict[str, Any]:
    """Run the scenario on this rank; return its acks, per-node load-back mismatches per
    layer (then the owned token count) and, on CUDA, ``overlap_ms``. ``keep_stacks``
    receives the stack instead of letting it go: a GPU process that builds several keeps
    them, since SGLang pins host pools with ``cudaHostRegister`` and never unregisters,
    so a later pool on a freed range fails to register."""
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    cfg = nsa_stack.StackConfig(
        cp_size=ctx.world_size, layer_num=LAYERS, physical_tokens=PAGE_SIZE * 24,
        io_backend=io_backend, mem_layout=layout, device=device,
    )  # fmt: skip
    stack = nsa_stack.build_rank_stack(cfg, ctx.rank, ctx.cp_group, ctx.attn_tp_group)
    timing = ForwardTiming(device)
    nodes = _reserve_nodes(stack, ctx.world_size)
    acks_before_last, acks = _forward(stack, nodes, timing, stall_cycles)
    loaded = _load_back(stack, nodes, device)
    stack.close()
    if keep_stacks is not None:
        keep_stacks.append(stack)
    return {
        "acks_before_last": acks_before_last, "acks": acks, "loaded": loaded,
        "overlap_ms": timing.overlap_ms(),
    }  # fmt: skip




#: node id -> (its reserved write, logical locs, token ids)
Nodes = Dict[int, Tuple[Any, torch.Tensor, torch.Tensor]]


def _reserve_nodes(stack: Any, cp_size: int) -> Nodes:
    """Every node's pages allocated on their owners and host pages reserved (the
    all-layer node's KV stored by an earlier forward)."""
    from sglang_cp_hicache.core.cp_shared_kv_layout import host_int64
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack
    from sglang_cp_hicache.v0_5_12.mem_cache.cp_hicache_metadata import PageRun

    controller = stack.cache.cache_controller
    nodes: Nodes = {}
    for node_id, owners in node_owners(cp_size).items():
        locs = stack.allocator.alloc_pages_with_owners(torch.tensor(owners))
        ids = torch.arange(len(locs)) + 1000 * node_id
        if node_id == ALL_LAYER_NODE:  # computed by an earlier forward
            nsa_stack.write_prefill_kv(stack, locs, ids, torch.arange(len(locs)))
        plan = controller.host_table.plan_write(PageRun.of(host_int64(locs), PAGE_SIZE))
        # _get_extra_pools is fresh per call: the controller fills its transfers in
        nodes[node_id] = (controller.reserve_write(plan, node_id, **stack.cache._get_extra_pools()), locs, ids)
    return nodes


def _forward(
    stack: Any, nodes: Nodes, timing: ForwardTiming, stall_cycles: int
) -> Tuple[List[List[int]], List[List[int]]]:
    """The per-layer nodes submitted, the forward's stores layer by layer (the all-layer
    node submitted at layer 1); the acks before the last layer and after the forward."""
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    controller = stack.cache.cache_controller
    for node_id in PER_LAYER_NODES:
        controller.submit_write(nodes[node_id][0], per_layer=True)
    stores = [  # computed ahead: the forward issues a layer's stores without a host sync
        nsa_stack.prepare_stores(stack, locs, ids, torch.arange(len(locs)))
        for _, locs, ids in (nodes[node_id] for node_id in PER_LAYER_NODES)
    ]
    acks_before_last: List[List[int]] = []
    for layer in range(LAYERS):
        timing.stall(stall_cycles)  # the layer's compute, before its stores
        for node_stores in stores:
            if node_stores is not None:
                node_stores.store(layer)
        if layer == 1:
            controller.submit_write(nodes[ALL_LAYER_NODE][0])
        if layer == LAYERS - 1:
            timing.last_layer_stored()
            acks_before_last = [list(ack.node_ids) for ack in controller.ack_write_queue]
        controller.backup_layer(layer)
        if layer == 0:
            timing.layer0_copied(controller.write_stream)
    for ack in controller.ack_write_queue:
        ack.finish_event.synchronize()
    acks = [list(ack.node_ids) for ack in controller.ack_write_queue]
    controller.ack_write_queue.clear()
    return acks_before_last, acks


def _load_back(stack: Any, nodes: Nodes, device: str) -> Dict[int, List[int]]:
    """Device KV wiped, each node loaded back: mismatched tokens per layer, then the
    owned token count."""
    from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

    controller = stack.cache.cache_controller
    nsa_stack.wipe_device_kv(stack)
    loaded: Dict[int, List[int]] = {}
    for node_id, (pending, _, ids) in nodes.items():
        new_locs = controller.load(pending.logical_host_locs, node_id=node_id, **stack.cache._get_extra_pools())
        controller.start_loading()
        if device != "cpu":
            torch.cuda.synchronize()
        loaded[node_id] = nsa_stack.kv_mismatches_per_layer(stack, new_locs, ids, torch.arange(len(new_locs)))
        loaded[node_id].append(int(stack.layout.owned_mask(new_locs).sum()) if len(new_locs) else 0)
    return loaded


def round_trip_problems(reports: List[Dict[str, Any]]) -> List[str]:
    """What the ranks' reports break of the contract, one line each (none: it held):
    on every rank the all-layer node acked first, before the last layer, then one ack for
    both per-layer nodes; every owned token of every layer loaded back byte-exact; every
    rank owns pages of node 11; only the last rank owns node 12 (the others' ack of it
    moved nothing)."""
    problems = []
    last = len(reports) - 1
    for rank, report in enumerate(reports):
        if report["acks_before_last"] != [[ALL_LAYER_NODE]]:
            problems.append(f"rank {rank}: acks before the last layer {report['acks_before_last']}")
        if report["acks"] != [[ALL_LAYER_NODE], list(PER_LAYER_NODES)]:
            problems.append(f"rank {rank}: acks {report['acks']}")
        problems += [
            f"rank {rank} node {node_id}: mismatched tokens per layer {per_layer}"
            for _, node_id, per_layer in stale_loads([report])
        ]
        if report["loaded"][11][-1] == 0:
            problems.append(f"rank {rank}: owns no page of node 11")
    owners_of_12 = [rank for rank, report in enumerate(reports) if report["loaded"][12][-1] > 0]
    if owners_of_12 != [last]:
        problems.append(f"node 12 owned by ranks {owners_of_12}, expected [{last}]")
    return problems


def stale_loads(reports: List[Dict[str, Any]]) -> List[Tuple[int, int, List[int]]]:
    """``(rank, node id, mismatched tokens per layer)`` of every node load that did not
    come back byte-exact."""
    return [
        (rank, node_id, per_layer[:-1])
        for rank, report in enumerate(reports)
        for node_id, per_layer in report["loaded"].items()
        if per_layer[:-1] != [0] * LAYERS
    ]


__all__ = [
    "LAYERS", "PAGE_SIZE", "node_owners", "per_layer_round_trip", "round_trip_problems", "stale_loads",
]
