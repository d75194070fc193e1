#!/usr/bin/env bash
# Fill a line's git-ignored bundle folder with the wheels the offline GPU host needs (<= 60 MiB).
#
#   scripts/gpu/prepare_bundle.sh                    # 0.5.12.post1 -> .gpucheck/
#   scripts/gpu/prepare_bundle.sh --sglang 0.5.23    # 0.5.23       -> .gpucheck-0.5.23/
#   scripts/gpu/prepare_bundle.sh [--sglang L] --dry-run   # print the plan
#
# cp312 manylinux x86_64 (or pure-Python) wheels, no dependency resolution: the line's list
# (scripts/gpu/bundle-requirements*.txt) plus its sglang-kernel, trimmed by bundle.py to what
# the line's sm90 path loads. 0.5.12.post1 trims the kernel only (keeps common_ops and
# flashmla_ops); 0.5.23 trims sglang-kernel 0.4.6 to sm90/common_ops, sglang, transformers,
# torchvision and pillow to what its check imports, and LZMA-compresses every wheel's larger
# members. torch / Triton stay the host's own. GPUCHECK_BUNDLE overrides the folder.
set -euo pipefail
cd "$(dirname "$0")/../.."

LINE=0.5.12.post1
DRY_RUN=0
usage="usage: $0 [--sglang 0.5.12.post1|0.5.23] [--dry-run]"
while [ $# -gt 0 ]; do
    case "$1" in
        --dry-run) DRY_RUN=1 ;;
        --sglang=*) LINE="${1#--sglang=}" ;;
        --sglang) [ $# -ge 2 ] || { echo "$usage" >&2; exit 2; }; LINE="$2"; shift ;;
        *) echo "$usage" >&2; exit 2 ;;
    esac
    shift
done
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
read -r BUNDLE_DIR REQUIREMENTS KERNEL < <($PY scripts/gpu/bundle.py describe --line "$LINE") || { echo "$usage" >&2; exit 2; }
BUNDLE="${GPUCHECK_BUNDLE:-$BUNDLE_DIR}"
PIP_DOWNLOAD="$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any --dest $BUNDLE/wheels"
if [ "$LINE" = 0.5.12.post1 ]; then
    TRIM="$PY scripts/gpu/bundle.py trim --line $LINE $BUNDLE/wheels/sglang_kernel-*.whl"
else
    TRIM="for each wheel: $PY scripts/gpu/bundle.py trim --line $LINE $BUNDLE/wheels/<wheel>"
fi

if [ "$DRY_RUN" = 1 ]; then
    echo "download: $PIP_DOWNLOAD -r scripts/gpu/$REQUIREMENTS $KERNEL"
    echo "trim: $TRIM"
    echo "manifest: $PY scripts/gpu/bundle.py manifest $BUNDLE"
    echo "check: $PY scripts/gpu/bundle.py check --line $LINE $BUNDLE"
    exit 0
fi

mkdir -p "$BUNDLE/wheels"
$PIP_DOWNLOAD -r "scripts/gpu/$REQUIREMENTS" "$KERNEL"
if [ "$LINE" = 0.5.12.post1 ]; then
    wheels=("$BUNDLE"/wheels/sglang_kernel-*.whl)
else
    wheels=("$BUNDLE"/wheels/*.whl)
fi
for wheel in "${wheels[@]}"; do
    $PY scripts/gpu/bundle.py trim --line "$LINE" "$wheel"
done
$PY scripts/gpu/bundle.py manifest "$BUNDLE"
$PY scripts/gpu/bundle.py check --line "$LINE" "$BUNDLE"
