# The SGLang lines this repository supports and each one's venv; sourced by setup_env.sh,
# run_tests.sh, run_sim.sh and serve_cpu.sh, so the mapping lives in one place.
SUPPORTED_LINES=(0.5.23 0.5.12.post1)

# venv_for_release ROOT RELEASE: the venv folder of RELEASE's line (exit 2 for any other release).
venv_for_release() {
  case "$2" in
    0.5.12.post1) echo "$1/.venv" ;;
    0.5.23) echo "$1/.venv-sglang-$2" ;;
    *) echo "sglang $2 is not a supported line (${SUPPORTED_LINES[*]})" >&2; return 2 ;;
  esac
}

# split_release_args DEFAULT ARG...: RELEASE from `--sglang R` / `--sglang=R` (DEFAULT when
# absent) and ARGS, every other argument in order (the calling script's own options).
split_release_args() {
  RELEASE="$1"
  shift
  ARGS=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --sglang) RELEASE="$2"; shift 2 ;;
      --sglang=*) RELEASE="${1#--sglang=}"; shift ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
}
