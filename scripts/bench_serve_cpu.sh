#!/usr/bin/env bash
# SGLang's own serving benchmark (python -m sglang.bench_serving) against the CPU PD cluster:
# the sharded prefill (a), an unsharded one with a's per-rank memory (b) and one with a's
# logical capacity (c), each behind its own router on one decode; throughput, TTFT, hit
# tokens by tier, ratios a/b and a/c, greedy outputs a vs c against c vs its rerun
# (benchmark/serving/bench_serve_cpu.py, docs/serving_on_cpu.md). SGLang 0.5.23 only. Sets up
# the venv first. Starts SGLang servers: on a shared box run it under the cluster lock.
#
#   scripts/bench_serve_cpu.sh                                     # the full matrix
#   scripts/bench_serve_cpu.sh --quick                             # a smoke run
#   scripts/bench_serve_cpu.sh --json out/serving.json --png out/serving.png
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lines.sh"
bash "$ROOT/scripts/setup_env.sh" --sglang 0.5.23
exec "$(venv_for_release "$ROOT" 0.5.23)/bin/python" "$ROOT/benchmark/serving/bench_serve_cpu.py" "$@"
