#!/usr/bin/env bash
# SGLang's own PD cluster on this CPU box with the plugin's flag: a sharded tp 2 prefill
# (HiCache, L3 where the line admits it) against its unsharded reference, a cp 1 decode,
# sglang-router, Mooncake over loopback TCP; every scenario, a table each, exit 1 on any
# difference (docs/serving_on_cpu.md). Sets up the line's venv first.
#
#   scripts/serve_cpu.sh                          # SGLang 0.5.23
#   scripts/serve_cpu.sh --sglang 0.5.12.post1    # the older line
#   scripts/serve_cpu.sh --scenarios host_load_back,l3_file --trace trace.jsonl
#   scripts/serve_cpu.sh --soak 20 [--soak-seed N]  # a soak with faults (docs/serving_on_cpu.md)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lines.sh"
split_release_args 0.5.23 "$@"
bash "$ROOT/scripts/setup_env.sh" --sglang "$RELEASE"
exec "$(venv_for_release "$ROOT" "$RELEASE")/bin/python" -m sglang_cp_hicache.testing.server "${ARGS[@]}"
