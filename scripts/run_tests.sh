#!/usr/bin/env bash
# The whole CPU test suite, set-up included (README's test command; .ci/run calls it).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
bash "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec .venv/bin/python -m pytest test/registered -q -p no:randomly "$@"
