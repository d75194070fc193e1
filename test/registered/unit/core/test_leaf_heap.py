"""The lane planners' persistent candidate heap (core.leaf_heap, no SGLang): across plans
that evict, leaves that join and leave the owner's set, and keys that grow, it yields the
members in exactly the (priority, node id) order a heap rebuilt per plan would."""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from itertools import islice
from typing import Dict, List, Set

from hypothesis import given, settings
from hypothesis import strategies as st

from sglang_cp_hicache.core.leaf_heap import LazyLeafHeap


@dataclass(eq=False)
class Node:
    id: int
    key: float = 0.0


@dataclass
class Tree:
    """A leaf set and its keys, as a tree core keeps them (keys grow: an access counter)."""

    nodes: Dict[int, Node] = field(default_factory=dict)
    members: Set[Node] = field(default_factory=set)
    clock: float = 0.0

    def tick(self) -> float:
        self.clock += 1.0
        return self.clock

    def priority(self, node: Node) -> float:
        return node.key


def rebuilt_order(members: Set[Node], priority) -> List[Node]:
    heap = [(priority(n), n.id, n) for n in members]
    heapq.heapify(heap)
    return [heapq.heappop(heap)[2] for _ in range(len(heap))]


OPS = st.lists(
    st.tuples(
        st.sampled_from(["join", "join", "leave", "touch", "touch", "plan", "order"]),
        st.integers(0, 7),  # the node
        st.integers(0, 4),  # the plan's length
    ),
    max_size=80,
)


@settings(max_examples=300, deadline=None)
@given(OPS, st.booleans())
def test_the_candidates_are_the_rebuilt_heaps_order_across_plans(ops, keys_only_grow) -> None:
    tree, heap = Tree(), LazyLeafHeap(keys_only_grow)
    for op, node_id, length in ops:
        node = tree.nodes.setdefault(node_id, Node(node_id, tree.tick()))
        if op == "join":  # a new leaf, or a node that became a leaf again
            tree.members.add(node)
        elif op == "leave":  # locked, evicted, or gained a child
            tree.members.discard(node)
        elif op == "touch":  # member or not, its key grows (ties on equal keys too)
            node.key = tree.tick() if node_id % 3 else node.key
        elif op == "plan":  # read a prefix of the order, then evict part of it
            want = rebuilt_order(tree.members, tree.priority)[:length]
            got = list(islice(heap.candidates(tree.members, tree.priority), length))
            assert got == want
            for victim in got[::2]:
                tree.members.discard(victim)
        else:  # the whole order, nothing evicted
            got = list(heap.candidates(tree.members, tree.priority))
            assert got == rebuilt_order(tree.members, tree.priority)
    assert list(heap.candidates(tree.members, tree.priority)) == rebuilt_order(
        tree.members, tree.priority
    )


def test_a_member_touched_since_it_was_queued_pops_at_its_new_key() -> None:
    a, b, c = Node(1, 1.0), Node(2, 2.0), Node(3, 3.0)
    members = {a, b, c}
    heap = LazyLeafHeap(keys_only_grow=True)
    assert next(heap.candidates(members, lambda n: n.key)) is a  # b queued at 2, c at 3
    b.key = 4.0
    assert list(heap.candidates(members, lambda n: n.key)) == [a, c, b]


def test_equal_keys_pop_by_node_id() -> None:
    members = {Node(i, 5.0) for i in (7, 2, 9, 4)}
    heap = LazyLeafHeap(keys_only_grow=True)
    assert [n.id for n in heap.candidates(members, lambda n: n.key)] == [2, 4, 7, 9]


def test_a_key_that_decreases_is_rebuilt_when_keys_may_decrease() -> None:
    """A decreasing key (MRU, session refs) is why such strategies rebuild per call: a
    persistent heap would still pop the node at its old, larger key."""
    a, b = Node(1, 1.0), Node(2, 2.0)
    members = {a, b}
    heap = LazyLeafHeap(keys_only_grow=False)
    assert list(heap.candidates(members, lambda n: n.key)) == [a, b]
    b.key = 0.0
    assert list(heap.candidates(members, lambda n: n.key)) == [b, a]


def test_stale_entries_are_compacted() -> None:
    """Nodes that left the set without reaching the front do not pile up: the heap holds
    at most twice the membership plus the slack."""
    tree, heap = Tree(), LazyLeafHeap(keys_only_grow=True)
    for i in range(5000):
        node = Node(i, tree.tick())
        tree.members.add(node)
        next(heap.candidates(tree.members, tree.priority))  # syncs
        tree.members.discard(node) if i % 10 else None
    assert len(heap) <= 2 * len(tree.members) + 1024 + 1
