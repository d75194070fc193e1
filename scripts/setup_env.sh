#!/usr/bin/env bash
# Builds .venv at the repository root for CPU development, the simulator and CI:
# torch 2.14.1 (from this machine's local wheels), sglang 0.5.12.post1 without its GPU
# dependencies, the pinned import-time list, test tools, and this package (editable).
# Idempotent: a venv whose stamp matches the pinned inputs is only refreshed.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.sglang-cp-hicache-stamp"
want="$(cat "$ROOT"/scripts/requirements-*.txt "$ROOT/scripts/constraints-cpu.txt" \
  "$ROOT/scripts/setup_env.sh" | sha256sum | cut -d' ' -f1)"

quiet_pip() {
  # sglang's GPU dependencies are left out on purpose; drop pip's complaints about them.
  local log
  log="$(mktemp)"
  if ! "$VENV/bin/python" -m pip "$@" >"$log" 2>&1; then
    cat "$log"
    rm -f "$log"
    return 1
  fi
  grep -vE "requires .*which is not installed|incompatible|^WARNING: Location" "$log" || true
  rm -f "$log"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  quiet_pip install -q --no-deps --no-build-isolation -e "$ROOT"
  exit 0
fi

start=$(date +%s)
"$PY" -m venv "$VENV"
PIP=(install -q --disable-pip-version-check -c "$ROOT/scripts/constraints-cpu.txt")
quiet_pip "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
quiet_pip "${PIP[@]}" --no-deps sglang==0.5.12.post1
quiet_pip "${PIP[@]}" -r "$ROOT/scripts/requirements-cpu.txt" -r "$ROOT/scripts/requirements-test.txt"
quiet_pip "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
"$VENV/bin/python" - <<'PY'
from sglang_cp_hicache.testing import install
install()
import sglang.srt.mem_cache.hiradix_cache  # noqa: F401  (fails here, not in the tests)
PY
echo "$want" > "$STAMP"
echo "setup_env: .venv ready in $(( $(date +%s) - start )) s"
