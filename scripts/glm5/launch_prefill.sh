#!/usr/bin/env bash
# GLM-5-FP8 PD prefill server: TP8, NSA prefill CP with shared KV, HiCache (GPUs 0-7).
# Options: see `python scripts/glm5/glm5_pd.py --help`; --dry-run prints the commands only.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/glm5_pd.py" prefill "$@"
