#!/usr/bin/env bash
# The whole CPU test suite of both SGLang lines, set-up included (README's test command;
# .ci/run calls it). Each line runs in its own venv (scripts/setup_env.sh): the 0.5.23 line
# in .venv-sglang-0.5.23, the 0.5.12.post1 line in .venv; the shared core and plugin tests
# run in both. Tests run in random order (pytest-randomly); each line's seed is printed
# first so that a failing order can be replayed:
#
#   scripts/run_tests.sh                                  # both lines
#   scripts/run_tests.sh --sglang 0.5.23 --randomly-seed=N  # one line, one order
#
# Other pytest options pass through (-p no:randomly restores file order). Both lines run
# even when the first fails; the exit status is non-zero when either failed.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/lines.sh"
LINES=("${SUPPORTED_LINES[@]}")
args=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --sglang) LINES=("$2"); shift 2 ;;
    --sglang=*) LINES=("${1#--sglang=}"); shift ;;
    *) args+=("$1"); shift ;;
  esac
done

cd "$ROOT"
status=0
summary=()
for release in "${LINES[@]}"; do
  bash "$ROOT/scripts/setup_env.sh" --sglang "$release" || { status=1; summary+=("sglang $release: set-up failed"); continue; }
  seed=()
  if [[ " ${args[*]:-} " != *" --randomly-seed"* && " ${args[*]:-} " != *" -p no:randomly "* ]]; then
    # Chosen here, not by the plugin: pytest -q does not show the plugin's seed header.
    seed=("--randomly-seed=$(( (RANDOM << 15) | RANDOM ))")
  fi
  echo "run_tests: sglang $release, test order ${seed[*]:-as given: ${args[*]:-}}"
  start=$(date +%s)
  "$(venv_for_release "$ROOT" "$release")/bin/python" -m pytest test/registered -q "${seed[@]}" "${args[@]}"
  rc=$?
  summary+=("sglang $release: pytest exit $rc in $(( $(date +%s) - start )) s ${seed[*]:-}")
  [[ $rc -eq 0 ]] || status=1
done
printf 'run_tests: %s\n' "${summary[@]}"
exit $status
