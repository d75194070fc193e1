"""plan_lane_victims: per-lane victim planning, on hand-built trees (no cache needed)."""

from typing import Dict, List, Optional, Set

from sglang.srt.mem_cache.radix_cache import TreeNode

from sglang_cp_hicache.v0_5_12.mem_cache.cp_lane_eviction import plan_lane_victims


class Tree:
    """Nodes with a priority and per-lane pages; a parent frees once its children are planned."""

    def __init__(self) -> None:
        self.root = TreeNode()
        self.lanes: Dict[TreeNode, List[int]] = {}
        self.priority: Dict[TreeNode, float] = {}

    def add(self, parent: Optional[TreeNode], priority: float, lanes: List[int]) -> TreeNode:
        node = TreeNode()
        node.parent = parent or self.root
        node.parent.children[len(node.parent.children)] = node
        self.lanes[node] = lanes
        self.priority[node] = priority
        return node

    def leaves(self) -> List[TreeNode]:
        leaves = [n for n in self.lanes if not n.children]
        return sorted(leaves, key=lambda n: (self.priority[n], n.id))

    def freed_parent(self, node: TreeNode, planned: Set[TreeNode]) -> Optional[TreeNode]:
        parent = node.parent
        if parent is self.root or any(c not in planned for c in parent.children.values()):
            return None
        return parent

    def plan(self, deficit: List[int]) -> Optional[List[TreeNode]]:
        return plan_lane_victims(
            iter(self.leaves()), deficit, self.lanes.__getitem__,
            self.freed_parent, self.priority.__getitem__,
        )  # fmt: skip


def test_only_nodes_with_pages_on_a_short_lane_are_planned_in_eviction_order():
    tree = Tree()
    old_lane1 = tree.add(None, 1.0, [0, 3])
    lane0_a = tree.add(None, 2.0, [1, 0])
    lane0_b = tree.add(None, 3.0, [2, 1])
    tree.add(None, 4.0, [5, 0])
    assert tree.plan([3, 0]) == [lane0_a, lane0_b]  # stops once lane 0 is covered
    assert old_lane1 not in tree.plan([1, 0])


def test_a_parent_competes_once_its_children_are_planned():
    tree = Tree()
    parent = tree.add(None, 0.5, [4, 0])  # oldest, but not a leaf
    child = tree.add(parent, 5.0, [1, 0])
    newer = tree.add(None, 6.0, [2, 0])
    assert tree.plan([3, 0]) == [child, parent]  # parent (0.5) pops before `newer` (6.0)
    assert newer not in tree.plan([5, 0])
    # A child that frees nothing on the short lane is never planned, so neither is its parent.
    tree2 = Tree()
    blocked = tree2.add(None, 0.5, [4, 0])
    tree2.add(blocked, 1.0, [0, 2])
    assert tree2.plan([2, 0]) is None


def test_a_shortfall_the_candidates_cannot_cover_plans_nothing():
    tree = Tree()
    tree.add(None, 1.0, [1, 1])
    tree.add(None, 2.0, [0, 5])
    assert tree.plan([2, 0]) is None
    assert tree.plan([1, 6]) == tree.leaves()
