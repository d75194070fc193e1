#!/usr/bin/env bash
# sglang_router in PD mode in front of the prefill and decode servers.
# Options: see `python scripts/glm5/glm5_pd.py --help`; --dry-run prints the commands only.
set -euo pipefail
exec "${PYTHON:-python3}" "$(dirname "$0")/glm5_pd.py" router "$@"
