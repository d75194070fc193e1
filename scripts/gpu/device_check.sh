#!/usr/bin/env bash
# Offline one-GPU check of CP shared KV (see docs/gpu_checks.md).
#
#   scripts/gpu/device_check.sh            # GPU host: install .gpucheck/ wheels offline, run the checks
#   scripts/gpu/device_check.sh --cpu      # this machine: same checks, CPU reference kernels, no install
#   scripts/gpu/device_check.sh --dry-run  # print what would run
#   scripts/gpu/device_check.sh --cpu --sglang 0.5.23  # the 0.5.23 line: startup self-test and
#                                          # read-path twins per admitted backend, CPU stand-ins
#
# Without --sglang (or --sglang 0.5.12.post1) this is the 0.5.12.post1 line's prepared check,
# the only one the offline GPU host can load (its torch 2.11 loads sglang-kernel 0.4.2.post2,
# not 0.5.23's 0.4.10, which needs torch 2.14.1); --sglang 0.5.23 therefore needs --cpu.
#
# GPU host: offline, Python 3.12, torch 2.11.0+cu130 and Triton 3.6 preinstalled, no sglang.
# The bundle (scripts/gpu/prepare_bundle.sh) is installed with --no-index --no-deps into a
# temp dir put on PYTHONPATH: the host's torch is never touched. Budget: install + run <= 9 min.
# Prints one PASS/FAIL line (then figures); writes $OUT/device_check.json when OUT is set.
set -uo pipefail
cd "$(dirname "$0")/../.."

DEVICE=cuda
DRY_RUN=0
CP=2
BUNDLE="${GPUCHECK_BUNDLE:-.gpucheck}"
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

if [ "$LINE" = 0.5.23 ]; then
    if [ "$DEVICE" != cpu ]; then
        echo "FAIL --sglang 0.5.23 runs with --cpu only: the offline GPU host's torch 2.11 cannot load sglang-kernel 0.4.10 (it needs torch 2.14.1), and no 0.5.23 bundle is prepared"
        exit 2
    fi
    PY="${PYTHON:-python3}"
    [ -z "${PYTHON:-}" ] && [ -x "$VENV/bin/python" ] && PY="$VENV/bin/python"
    CHECK_CMD="timeout 560 $PY scripts/gpu/device_check.py --sglang 0.5.23 --device cpu --cp $CP --timeout 500"
    if [ "$DRY_RUN" = 1 ]; then
        echo "install: none (--cpu uses this environment: $PY)"
        echo "check: PYTHONPATH=python $CHECK_CMD"
        exec env PYTHONPATH=python $PY scripts/gpu/device_check.py --sglang 0.5.23 --device cpu --cp "$CP" --dry-run
    fi
    start=$(date +%s)
    export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
    $CHECK_CMD
    status=$?
    [ $status -eq 124 ] && echo "FAIL check timed out after 560 s"
    echo "wall: $(( $(date +%s) - start )) s"
    exit $status
fi

PY="${PYTHON:-python3}"
[ "$DEVICE" = cpu ] && [ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
SITE="${GPUCHECK_SITE:-<temp dir>}"
CHECK_CMD="timeout 360 $PY scripts/gpu/device_check.py --device $DEVICE --cp $CP --timeout 300"
INSTALL_CMD="$PY scripts/gpu/bundle.py check $BUNDLE && $PY -m pip install --quiet --no-index --no-deps --no-compile --target $SITE $BUNDLE/wheels/*.whl"

if [ "$DRY_RUN" = 1 ]; then
    [ "$DEVICE" = cuda ] && echo "install: $INSTALL_CMD" || echo "install: none (--cpu uses this environment)"
    echo "check: PYTHONPATH=$([ "$DEVICE" = cuda ] && echo "$SITE:")python $CHECK_CMD"
    exec env PYTHONPATH=python $PY scripts/gpu/device_check.py --device "$DEVICE" --cp "$CP" --dry-run
fi

start=$(date +%s)
export PYTHONPATH="python${PYTHONPATH:+:$PYTHONPATH}"
if [ "$DEVICE" = cuda ]; then
    # The install's temp dir only where something is installed (--cpu left one behind per run).
    [ "$SITE" = "<temp dir>" ] && SITE="$(mktemp -d -t gpucheck-site.XXXXXX)" && INSTALL_CMD="${INSTALL_CMD//<temp dir>/$SITE}"
    if [ ! -d "$BUNDLE/wheels" ]; then
        echo "FAIL no bundle at $BUNDLE/wheels: run scripts/gpu/prepare_bundle.sh on a machine with PyPI access"
        exit 1
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
[ $status -eq 124 ] && echo "FAIL check timed out after 360 s"
echo "wall: $(( $(date +%s) - start )) s"
exit $status
