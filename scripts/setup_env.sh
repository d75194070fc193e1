#!/usr/bin/env bash
# Builds one SGLang line's venv at the repository root for CPU development, the simulator and
# CI: torch 2.14.1 (from this machine's local wheels), sglang without its GPU dependencies,
# that line's pinned import-time list (with Mooncake's CPU transfer engine), test tools, and this
# package (editable); as root, also the libibverbs1 system package that engine loads.
#
#   bash scripts/setup_env.sh                       # .venv                 (sglang 0.5.12.post1)
#   bash scripts/setup_env.sh --sglang 0.5.23       # .venv-sglang-0.5.23   (sglang 0.5.23)
#
# Idempotent: a venv whose stamp matches the pinned inputs is only refreshed. VENV overrides
# the venv's folder.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lines.sh"
split_release_args 0.5.12.post1 "$@"
if [[ ${#ARGS[@]} -gt 0 ]]; then
  echo "setup_env: unknown option ${ARGS[0]} (use --sglang 0.5.12.post1|0.5.23)" >&2
  exit 2
fi
DEFAULT_VENV="$(venv_for_release "$ROOT" "$RELEASE")" || exit 2
VENV="${VENV:-$DEFAULT_VENV}"
REQ="$ROOT/scripts/requirements-cpu-sglang-$RELEASE.txt"
CONSTRAINTS="$ROOT/scripts/constraints-cpu-sglang-$RELEASE.txt"
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP="$VENV/.sglang-cp-hicache-stamp"
want="$(cat "$REQ" "$CONSTRAINTS" "$ROOT/scripts/requirements-test.txt" \
  "$ROOT/scripts/setup_env.sh" "$ROOT/scripts/lines.sh" | sha256sum | cut -d' ' -f1)"

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

ensure_libibverbs() {
  # Mooncake's transfer engine links libibverbs.so.1 even over TCP (no RDMA device needed).
  if dpkg -s libibverbs1 >/dev/null 2>&1; then
    return 0
  fi
  if [[ "$(id -u)" != 0 ]]; then
    echo "setup_env: libibverbs1 is missing and this is not root: run" \
      "'apt-get install -y --no-install-recommends libibverbs1' as root, or the PD" \
      "transfer tests fail to import mooncake.engine" >&2
    return 0
  fi
  echo "setup_env: installing libibverbs1 (Mooncake's transfer engine needs libibverbs.so.1)"
  apt-get update -q >/dev/null
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends libibverbs1 >/dev/null
}
ensure_libibverbs

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$want" ]]; then
  quiet_pip install -q --no-deps --no-build-isolation -e "$ROOT"
  exit 0
fi

require_free_disk() {
  # A venv holds about 6.4 GiB (torch's CUDA build); a disk that fills mid-install fails with
  # pages of pip warnings and a half-built venv, so say it first, in one line.
  local need_gib=8 folder free_gib
  folder="$(dirname "$VENV")"
  free_gib=$(( $(df -Pk "$folder" | awk 'NR == 2 {print $4}') / 1024 / 1024 ))
  if (( free_gib < need_gib )); then
    echo "setup_env: $(basename "$VENV") needs about $need_gib GiB free in $folder;" \
      "$free_gib GiB are free there" >&2
    exit 1
  fi
}
require_free_disk

start=$(date +%s)
"$PY" -m venv "$VENV"
PIP=(install -q --disable-pip-version-check --no-cache-dir -c "$CONSTRAINTS")
quiet_pip "${PIP[@]}" torch==2.14.1 torchvision==0.29.1
quiet_pip "${PIP[@]}" --no-deps "sglang==$RELEASE"
quiet_pip "${PIP[@]}" -r "$REQ" -r "$ROOT/scripts/requirements-test.txt"
quiet_pip "${PIP[@]}" --no-deps --no-build-isolation -e "$ROOT"
# Fails here, not in the tests, when the line's CPU runtime cannot bring up its cache stack.
"$VENV/bin/python" -c "from sglang_cp_hicache.testing import install, warm_import; install(); warm_import()"
if dpkg -s libibverbs1 >/dev/null 2>&1; then
  "$VENV/bin/python" -c "import mooncake.engine"  # the PD transfer tests' engine
fi
echo "$want" > "$STAMP"
echo "setup_env: $(basename "$VENV") (sglang $RELEASE) ready in $(( $(date +%s) - start )) s"
