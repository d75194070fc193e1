#!/usr/bin/env bash
# GLM-5-FP8 PD decode server: TP8, receives full KV from the prefill CP ranks (GPUs 8-15;
# with --nodes 2 GPUs 0-7 of the decode node, run there).
# Options: see `python scripts/glm5/glm5_pd.py --help`; --dry-run prints the commands only.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/glm5_pd.py" decode "$@"
