#!/usr/bin/env bash
# Runs, on this machine, every case of the test matrices that CI runs a covering subset of
# (tests/matrix.py: the emulated CUDA hash-table kernels, the Triton half-row updates under the
# interpreter, tiered tables killed at random times, growths out of memory at every allocation) and writes its summary to benchmarks/results/full_matrix.md.
set -euo pipefail
cd "$(dirname "$0")/.."
export TORCHREC_EXT_FULL_MATRIX=1
summary=()
status=0
run() {  # run NAME [VAR=VALUE ...] -- PYTEST_ARGS...
  local name=$1 log start rc vars=()
  shift
  while [[ $1 != -- ]]; do vars+=("$1"); shift; done
  shift
  log=$(mktemp)
  start=$(date +%s)
  set +e
  env "${vars[@]}" .venv/bin/python -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  set -e
  summary+=("| $name | $(grep -E '(passed|failed|error)' "$log" | tail -1) | $(($(date +%s) - start)) s | $rc |")
  rm -f "$log"
  [[ $rc == 0 ]] || status=1
}
run "CUDA hash-table kernels, warp emulator" -- tests/test_cuda_kernels_emulated.py
# The Triton interpreter variants exist only in the child run that test_interpreter_run starts.
run "Triton kernels, TRITON_INTERPRET=1" TRITON_INTERPRET=1 TORCHREC_EXT_TRITON_INTERPRET_CHILD=1 -- tests/test_triton_kernels.py
run "Tiered tables, SIGKILL at random times (issue 16)" -- tests/test_tiers_crash.py -k random
run "Growth, out of memory at every allocation (issue 15)" -- tests/test_growth_faults.py
run "Sharded steps under the meta device context, 2 gloo ranks" -- tests/test_default_device.py -k sharded
{
  echo "# The full test matrices (opt-in drills)"
  echo
  echo "\`bash scripts/full_matrix.sh\` at $(git rev-parse --short HEAD) on $(date -u +%Y-%m-%d), $(nproc) cores."
  echo "CI runs a covering subset of these files' largest parametrizations (every value of every axis"
  echo "at least once); this runs every case. Skips are the CUDA-only variants (no GPU here)."
  echo
  echo "| drill | pytest | time | exit |"
  echo "|---|---|---|---|"
  printf '%s\n' "${summary[@]}"
} > benchmarks/results/full_matrix.md
exit "$status"
