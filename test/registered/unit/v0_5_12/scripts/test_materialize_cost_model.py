"""benchmark/cp_shared_kv_cost_model.py: bytes per strategy and the hide/no-hide verdict."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[5]
sys.path.insert(0, str(ROOT / "benchmark"))

import cp_shared_kv_cost_model as cost  # noqa: E402


def test_glm5_bytes_per_forward_per_rank():
    rows = {r.strategy: r for r in cost.cost_rows(cost.MODELS["glm5"], 131072, 8192, 8, fp8=True)}
    per_layer = 131072 * 788 * 7 // 8
    assert rows["all_gather"].bytes_per_layer == per_layer
    assert rows["all_reduce"].bytes_per_layer == 2 * per_layer
    assert rows["all_gather"].bytes_per_forward == 78 * per_layer


def test_small_chunks_do_not_hide_and_large_ones_do():
    model = cost.MODELS["glm5"]
    even = cost.break_even_chunk(model, 131072, 8, False, "all_reduce")
    assert even > cost.break_even_chunk(model, 131072, 8, False, "all_gather") > 0
    below = {r.strategy: r for r in cost.cost_rows(model, 131072, even - 256, 8, False)}
    at = {r.strategy: r for r in cost.cost_rows(model, 131072, even, 8, False)}
    assert not below["all_reduce"].hidden and at["all_reduce"].hidden


def test_benchmark_cli_prints_the_cost_table():
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmark" / "bench_cp_shared_kv_materialize.py"),
         "--model", "glm5", "--prefix", "131072", "--cp", "8"],
        capture_output=True, text=True, timeout=120, env={"PYTHONPATH": str(ROOT / "python"), "PATH": "/usr/bin:/bin"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert "GLM-5: 78 layers" in out.stdout and "prefix 131072, chunk 8192, cp 8" in out.stdout
    assert "all_gather           90.4             7.05" in out.stdout
    assert "NVLink ms/layer" in out.stdout and "chunk compute ms/layer" in out.stdout
