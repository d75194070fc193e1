#!/usr/bin/env bash
# Repeated-prefix workload (device eviction + host load-back); prints hit rates, fails on errors.
# Options: see `python scripts/glm5/glm5_pd.py --help`; --dry-run prints the commands only.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/glm5_pd.py" repeated-prefix "$@"
