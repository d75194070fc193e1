#!/usr/bin/env bash
# README's main job on a CPU machine: set-up, then the multi-rank CP HiCache simulator.
# Extra arguments go to the simulator (see `--help`).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -W ignore -m sglang_cp_hicache.sim "$@"
