#!/usr/bin/env bash
# README's main job on a CPU machine: set-up, then the multi-rank CP HiCache simulator.
#   bash scripts/run_sim.sh [--sglang 0.5.23|0.5.12.post1] [simulator options, see --help]
# Runs the 0.5.23 line (.venv-sglang-0.5.23) by default: its columns are the plugin, upstream's
# native sharding alone and upstream unsharded at cp 1; --sglang 0.5.12.post1 runs the older line.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lines.sh"
split_release_args 0.5.23 "$@"
VENV="$(venv_for_release "$ROOT" "$RELEASE")" || exit 2
bash "$ROOT/scripts/setup_env.sh" --sglang "$RELEASE"
cd "$ROOT"
exec "$VENV/bin/python" -W ignore -m sglang_cp_hicache.sim "${ARGS[@]}"
