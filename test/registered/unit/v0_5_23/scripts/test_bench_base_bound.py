"""benchmark/bench_base_bound.py: the rotation-base floor of a workload's sharded traffic."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "benchmark"))

import bench_base_bound as bound  # noqa: E402

from sglang_cp_hicache.sim.config import SimConfig  # noqa: E402


def test_lane_loads_follow_the_rotation_from_each_base():
    # Two prompts: 3 position-pages of 10, 20, 30 units, and 1 of 5, at cp 4.
    per_position = [[10, 20, 30], [5]]
    assert bound.lane_loads(per_position, (0, 0), 4) == [15, 20, 30, 0]
    assert bound.lane_loads(per_position, (0, 3), 4) == [10, 20, 30, 5]
    assert bound.lane_loads(per_position, (2, 1), 4) == [30, 5, 10, 20]
    assert bound.ratio([10, 20, 30, 0]) == 2.0 and bound.ratio([0, 0]) == 1.0


def test_the_trace_demand_counts_every_sent_token_and_each_new_page_once():
    cfg = SimConfig.preset("default", cp_size=4, seed=3, num_requests=40)
    demand = bound.prompt_demand(cfg)
    from sglang_cp_hicache.sim.workload import generate_workload

    requests = generate_workload(cfg)
    assert sum(map(sum, demand.sent_tokens)) == sum(len(r.token_ids) for r in requests)
    # Each session backs up its page-aligned growth; each system prompt's pages once.
    grown, sessions = 0, {}
    for request in requests:
        full = len(request.token_ids) // cfg.page_size
        grown += full - sessions.get(request.session_id, 0)
        sessions[request.session_id] = full
    shared = cfg.system_prompt_len // cfg.page_size
    prompts_used = sum(1 for pages in demand.sent_tokens if any(pages))
    sessions_started = len(sessions)
    assert sum(map(sum, demand.backup_pages)) == grown - shared * (sessions_started - prompts_used)


def test_the_floor_is_the_best_over_every_assignment_and_the_cli_prints_it():
    demand = bound.PromptDemand(sent_tokens=[[4, 4], [4, 4]], backup_pages=[[1, 1], [1, 1]])
    result = bound.base_bound(demand, 4)
    assert result.best_sent == (1.0, (0, 2)) and result.best_both == (1.0, (0, 2))
    assert result.worst_sent == 2.0  # both prompts on lanes 0-1
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "bench_base_bound.py"), "--workloads", "default",
         "--cp-sizes", "8", "--seeds", "0"],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "python")},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    (row,) = [line for line in out.stdout.splitlines() if line.split()[:3] == ["default", "8", "0"]]
    assert float(row.split()[3]) > 1.0 and "(no base rule meets the target)" in row
