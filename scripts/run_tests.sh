#!/usr/bin/env bash
# The whole CPU test suite, set-up included (README's test command; .ci/run calls it).
# Tests run in random order (pytest-randomly); the seed is printed first so that a failing
# order can be replayed: scripts/run_tests.sh --randomly-seed=N (other pytest options pass
# through too; -p no:randomly restores file order).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
seed=()
if [[ " $* " != *" --randomly-seed"* && " $* " != *" -p no:randomly "* ]]; then
  # Chosen here, not by the plugin: pytest -q does not show the plugin's seed header.
  seed=("--randomly-seed=$(( (RANDOM << 15) | RANDOM ))")
fi
echo "run_tests: test order ${seed[*]:-as given: $*}"
exec .venv/bin/python -m pytest test/registered -q "${seed[@]}" "$@"
