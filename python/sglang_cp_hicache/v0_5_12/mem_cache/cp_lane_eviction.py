"""Lane-targeted victim planning for CP HiCache on the 0.5.12 line (device and host tiers).

The planner is SGLang-free and shared with the 0.5.23 line
(:mod:`sglang_cp_hicache.core.lane_eviction`); this module names it for the 0.5.12 line's
``TreeNode`` callers. Every rank plans the same victims from replicated state, no
collective; an uncoverable deficit plans nothing (None) and the caller evicts nothing.
"""

from __future__ import annotations

from sglang_cp_hicache.core.lane_eviction import (
    FreedParent,
    LanePages,
    Priority,
    plan_lane_victims,
)

__all__ = ["FreedParent", "LanePages", "Priority", "plan_lane_victims"]
