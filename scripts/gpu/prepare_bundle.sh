#!/usr/bin/env bash
# Fill the git-ignored .gpucheck/ with the wheels the offline GPU host needs (<= 60 MiB).
#
#   scripts/gpu/prepare_bundle.sh            # download (PyPI), trim sglang-kernel, manifest, check
#   scripts/gpu/prepare_bundle.sh --dry-run  # print the plan
#
# cp312 manylinux x86_64 (or pure-Python) wheels, no dependency resolution: the list is
# scripts/gpu/bundle-requirements.txt plus sglang-kernel==0.4.2.post2, which is trimmed to
# what the sm90 NSA path loads (keeps common_ops and flashmla_ops; drops flash_ops, sm100,
# lib, mscclpp, include, triton_kernels). torch / Triton stay the host's own.
set -euo pipefail
cd "$(dirname "$0")/../.."

BUNDLE="${GPUCHECK_BUNDLE:-.gpucheck}"
PY="${PYTHON:-python3}"
[ -z "${PYTHON:-}" ] && [ -x .venv/bin/python ] && PY=.venv/bin/python
KERNEL="sglang-kernel==0.4.2.post2"
PIP_DOWNLOAD="$PY -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any --dest $BUNDLE/wheels"

if [ "${1:-}" = "--dry-run" ]; then
    echo "download: $PIP_DOWNLOAD -r scripts/gpu/bundle-requirements.txt $KERNEL"
    echo "trim: $PY scripts/gpu/bundle.py trim-kernel $BUNDLE/wheels/sglang_kernel-*.whl"
    echo "manifest: $PY scripts/gpu/bundle.py manifest $BUNDLE"
    echo "check: $PY scripts/gpu/bundle.py check $BUNDLE"
    exit 0
fi

mkdir -p "$BUNDLE/wheels"
$PIP_DOWNLOAD -r scripts/gpu/bundle-requirements.txt "$KERNEL"
for wheel in "$BUNDLE"/wheels/sglang_kernel-*.whl; do
    $PY scripts/gpu/bundle.py trim-kernel "$wheel"
done
$PY scripts/gpu/bundle.py manifest "$BUNDLE"
$PY scripts/gpu/bundle.py check "$BUNDLE"
