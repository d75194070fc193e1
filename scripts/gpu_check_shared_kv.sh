#!/usr/bin/env bash
# CP shared-KV check on one GPU: two processes (gloo CP group) compare shared vs replicated
# KV through SGLang's NSATokenToKVPool kernels. Prints one PASS/FAIL line and timings.
#
#   scripts/gpu_check_shared_kv.sh            # GPU run (installs sglang==0.5.12.post1 if missing)
#   scripts/gpu_check_shared_kv.sh --cpu      # same driver on CPU with the torch reference
#   scripts/gpu_check_shared_kv.sh --dry-run  # print what would run
#
# Budget: install <= 300 s, check <= 150 s (under 8 minutes in all).
set -uo pipefail
cd "$(dirname "$0")/.."

DEVICE=cuda
DRY_RUN=0
CP=2
for arg in "$@"; do
    case "$arg" in
        --cpu) DEVICE=cpu ;;
        --dry-run) DRY_RUN=1 ;;
        --cp=*) CP="${arg#--cp=}" ;;
        *) echo "usage: $0 [--cpu] [--dry-run] [--cp=N]" >&2; exit 2 ;;
    esac
done

PY="${PYTHON:-python3}"
[ -x .venv/bin/python ] && PY=.venv/bin/python
INSTALL_CMD="$PY -m pip install --quiet sglang==0.5.12.post1 && $PY -m pip install --quiet --no-deps -e ."
CHECK_CMD="timeout 150 $PY scripts/gpu_check_shared_kv.py --device $DEVICE --cp $CP --timeout 120"

if [ "$DRY_RUN" = 1 ]; then
    echo "install (only if sglang/sglang_cp_hicache are not importable): $INSTALL_CMD"
    echo "check: $CHECK_CMD"
    exec $PY scripts/gpu_check_shared_kv.py --device "$DEVICE" --cp "$CP" --dry-run
fi

start=$(date +%s)
if ! $PY -c "import sglang, sglang_cp_hicache" >/dev/null 2>&1; then
    if ! timeout 300 bash -c "$INSTALL_CMD"; then
        echo "FAIL could not install sglang==0.5.12.post1 and the plugin ($(( $(date +%s) - start )) s)"
        exit 1
    fi
fi
$CHECK_CMD
status=$?
[ $status -eq 124 ] && echo "FAIL check timed out after 150 s"
echo "wall: $(( $(date +%s) - start )) s"
exit $status
