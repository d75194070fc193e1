"""``writing_check`` all-reduces one persistent count tensor; acks keep order and cardinality.

A stand-in for the attention-group all-reduce plays a slower peer rank (MIN of the counts):
only the acks finished everywhere pop, in queue order, and the tensor is the same object on
every call. Zero-owned CP writes still yield exactly one ack each.
"""

from __future__ import annotations

import pytest
import torch

from sglang_cp_hicache.testing.v0_5_12 import nsa_stack

PS = 64


def _stack(gloo_world1, shared_kv: bool):
    return nsa_stack.unit_stack(gloo_world1, shared_kv, layer_num=1)


class SlowPeer:
    """All-reduce stand-in: MIN with the acks a peer rank has finished so far."""

    def __init__(self) -> None:
        self.peer_finished = 0
        self.tensors = []

    def __call__(self, tensor: torch.Tensor, op) -> None:
        assert op == torch.distributed.ReduceOp.MIN
        self.tensors.append(tensor)
        tensor.fill_(min(int(tensor), self.peer_finished))


@pytest.mark.parametrize("shared_kv", [False, True], ids=["cp_off", "cp_on"])
def test_acks_pop_in_order_through_one_persistent_min_reduced_tensor(gloo_world1, shared_kv):
    stack = _stack(gloo_world1, shared_kv)
    cache = stack.cache
    peer = SlowPeer()
    cache._all_reduce_attn_groups = peer
    nodes = [nsa_stack.insert_at_root(stack, list(range(i * 1000, i * 1000 + PS))) for i in range(1, 4)]
    assert len(cache.cache_controller.ack_write_queue) == 3

    popped = []
    for peer.peer_finished in (0, 1, 3):
        cache.writing_check()
        popped.append([n.id for n in nodes if n.id not in cache.ongoing_write_through])
    assert popped == [[], [nodes[0].id], [n.id for n in nodes]]
    assert all(n.lock_ref == 0 for n in nodes)
    assert len(peer.tensors) == 3 and all(t is peer.tensors[0] for t in peer.tensors)
    assert not cache.cache_controller.ack_write_queue
    cache.writing_check()  # nothing in flight: no collective at all
    assert len(peer.tensors) == 3
    stack.close()


def test_zero_owned_writes_ack_once_each(gloo_world1):
    stack = _stack(gloo_world1, shared_kv=True)
    cache = stack.cache
    peer = SlowPeer()
    peer.peer_finished = 10
    cache._all_reduce_attn_groups = peer
    lane1_only = stack.allocator.alloc_pages_with_owners(torch.ones(2, dtype=torch.int64))
    zero_owned = nsa_stack.insert_at_root(stack, list(range(1, 1 + 2 * PS)), lane1_only)
    mixed = nsa_stack.insert_at_root(stack, list(range(9000, 9000 + 2 * PS)))
    # Pending until the ack: the reservation says which rank transfers anything.
    assert cache.pending_backups[zero_owned.id].write.operation is None
    assert cache.pending_backups[mixed.id].write.operation is not None
    acked = [ids for ack in cache.cache_controller.ack_write_queue for ids in ack.node_ids]
    assert acked == [zero_owned.id, mixed.id]
    cache.writing_check()
    assert cache.node_host_metadata(zero_owned).owned_len == 0
    assert cache.node_host_metadata(mixed).owned_len > 0
    assert not cache.ongoing_write_through and not cache.cache_controller.ack_write_queue
    assert zero_owned.lock_ref == mixed.lock_ref == 0
    stack.close()
