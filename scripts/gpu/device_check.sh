#!/usr/bin/env bash
# Offline one-GPU check of CP shared KV (see docs/gpu_checks.md).
#
#   scripts/gpu/device_check.sh                    # GPU host: install .gpucheck/ offline, run the 0.5.12.post1 checks
#   scripts/gpu/device_check.sh --sglang 0.5.23    # GPU host: install .gpucheck-0.5.23/ offline, run the 0.5.23 checks
#   scripts/gpu/device_check.sh --cpu [--sglang L] # this machine: the line's CPU checks, no install
#   scripts/gpu/device_check.sh ... --dry-run      # print what would run
#
# GPU host: offline, Python 3.12, torch 2.11.0+cu130 and Triton 3.6 preinstalled, no sglang.
# A line's bundle (scripts/gpu/prepare_bundle.sh [--sglang L]) is installed with --no-index
# --no-deps into a temp dir put first on PYTHONPATH: the host's torch is never touched. The
# 0.5.23 bundle carries sglang-kernel 0.4.6, the newest build linked against torch 2.11
# (0.5.23 pins 0.4.10, which needs torch 2.14.1). Budget: install + run <= 9 min.
# Prints one PASS/FAIL line (then figures); writes $OUT/device_check.json when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=cuda
DRY_RUN=0
CP=2
LINE=0.5.12.post1
usage="usage: $0 [--cpu] [--dry-run] [--cp=N] [--sglang 0.5.12.post1|0.5.23]"
while [ $# -gt 0 ]; do
    case "$1" in
        --cpu) DEVICE=cpu ;;
        --dry-run) DRY_RUN=1 ;;
        --cp=*) CP="${1#--cp=}" ;;
        --sglang=*) LINE="${1#--sglang=}" ;;
        --sglang) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; LINE="$2"; shift ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
    shift
done
source scripts/lines.sh
VENV="$(venv_for_release "$PWD" "$LINE")" || exit 2

PY="${PYTHON:-python3}"
[ "$DEVICE" = cpu ] && [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"
if [ "$LINE" = 0.5.23 ]; then
    LINE_ARGS="--sglang 0.5.23 "
    if [ "$DEVICE" = cpu ]; then LIMIT=560; RANKS=500; else LIMIT=400; RANKS=340; fi
else
    LINE_ARGS=""
    LIMIT=360
    RANKS=300
fi
BUNDLE="${GPUCHECK_BUNDLE:-$($PY scripts/gpu/bundle.py describe --line "$LINE" | cut -d' ' -f1)}"
SITE="${GPUCHECK_SITE:-<temp dir>}"
CHECK_CMD="timeout $LIMIT $PY scripts/gpu/device_check.py ${LINE_ARGS}--device $DEVICE --cp $CP --timeout $RANKS"
INSTALL_CMD="$PY scripts/gpu/bundle.py check --line $LINE $BUNDLE && $PY -m pip install --quiet --no-index --no-deps --no-compile --target $SITE $BUNDLE/wheels/*.whl"

if [ "$DRY_RUN" = 1 ]; then
    [ "$DEVICE" = cuda ] && echo "install: $INSTALL_CMD" || echo "install: none (--cpu uses this environment: $PY)"
    echo "check: PYTHONPATH=$([ "$DEVICE" = cuda ] && echo "$SITE:")python $CHECK_CMD"
    exec env PYTHONPATH=python $PY scripts/gpu/device_check.py ${LINE_ARGS}--device "$DEVICE" --cp "$CP" --dry-run
fi

start=$(date +%s)
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then
    if [ ! -d "$BUNDLE/wheels" ]; then
        echo "FAIL no bundle at $BUNDLE/wheels: run scripts/gpu/prepare_bundle.sh ${LINE_ARGS}on a machine with PyPI access"
        exit 1
    fi
    # The install's temp dir only where something is installed, and gone with the check.
    if [ "$SITE" = "<temp dir>" ]; then
        SITE="$(mktemp -d -t gpucheck-site.XXXXXX)"
        trap 'rm -rf "$SITE"' EXIT
        INSTALL_CMD="${INSTALL_CMD//<temp dir>/$SITE}"
    fi
    if ! timeout 180 bash -c "$INSTALL_CMD"; then
        echo "FAIL offline install of $BUNDLE into $SITE failed ($(( $(date +%s) - start )) s)"
        exit 1
    fi
    export PYTHONPATH="$SITE:$PYTHONPATH"
    if ! $PY -c "import numpy, torch, triton" 2>/dev/null; then
        echo "FAIL the GPU host must provide numpy, torch and triton (not bundled): $($PY -c 'import numpy, torch, triton' 2>&1 | tail -1)"
        exit 1
    fi
    echo "installed $(ls "$BUNDLE"/wheels/*.whl | wc -l) wheels into $SITE in $(( $(date +%s) - start )) s" >&2
fi
$CHECK_CMD
status=$?
[ $status -eq 124 ] && echo "FAIL check timed out after $LIMIT s"
echo "wall: $(( $(date +%s) - start )) s"
exit $status
