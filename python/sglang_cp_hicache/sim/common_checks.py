"""Ledger checks both lines' ``PoolLedger`` share (``sim/<line>/invariants.py``).

Only the walk and the messages are shared: each line passes what it reads from its own
SGLang objects (the tree's root, how a node's lock count is read). Imports no SGLang.
"""

from __future__ import annotations

from typing import Any, Callable, Counter


def pending_io(writes: int, loads: int, violation: Callable[[str], None]) -> bool:
    """Between batches no write (``writes``: those not allowed in flight) or load may be
    pending; reports it and returns True when one is."""
    if writes or loads:
        violation(f"{writes} writes / {loads} loads still pending after check_hicache_events")
        return True
    return False


def check_lock_refs(
    root: Any,
    holders: Counter,
    lock_ref: Callable[[Any], int],
    violation: Callable[[str], None],
) -> None:
    """Each node's ``lock_ref(node)`` equals the locks taken at or below it (``holders``:
    node id -> locks taken on that node); the first node that differs is reported."""
    order, stack = [], [root]
    while stack:
        node = stack.pop()
        order.append(node)
        stack.extend(node.children.values())
    below = {}
    for node in reversed(order):  # children before parents
        count = holders[node.id] + sum(below[c.id] for c in node.children.values())
        below[node.id] = count
        if node is not root and lock_ref(node) != count:
            violation(
                f"node {node.id}: lock_ref {lock_ref(node)} between batches, {count} locks of "
                "writes in flight and running requests at or below it"
            )
            return
