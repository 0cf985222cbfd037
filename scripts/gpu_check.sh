#!/usr/bin/env bash
# One command on a GPU machine (torch + triton importable; torchrec + fbgemm-gpu[-cpu] importable or
# their wheels in .whl/): builds the CUDA extension in place, runs the whole test suite (CUDA variants
# included), then benchmarks/gpu_check.py (host syncs of a training step, a one-step profile, pooled
# lookup GB/s vs copy bandwidth, the GPU benchmarks). No venv is created.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run | --cpu-smoke]
#
# OUT_DIR (default benchmarks/results/) gets build.log, gpu_tier_tests.txt, gpu_tests.txt + gpu_tests.xml
# (junit), gpu_check.md (the report), gpu_check.jsonl (one JSON row per step) and each benchmark's
# results (tiers_gpu.md: the tiered tables vs TorchRec's UVM caching).
# --dry-run prints the commands without running them; --cpu-smoke runs the build and the driver at
# tiny sizes on the CPU (checks the pytest invocation with --collect-only instead of running it).
# Exit status: non-zero when the build, any test or any step of the driver failed.
# Environment: PYTHON (default python3), CUDA_HOME / TORCH_CUDA_ARCH_LIST (read by setup.py: sm_90 +
# compute_90 PTX by default), WHEEL_SITE (where .whl/ is installed, default /tmp/site).
set -uo pipefail
cd "$(dirname "$0")/.."

out=benchmarks/results
mode=gpu
for arg in "$@"; do
  case "$arg" in
    --dry-run) mode=dry ;;
    --cpu-smoke) mode=cpu ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $arg" >&2; exit 2 ;;
    *) out=$arg ;;
  esac
done
PY=${PYTHON:-python3}
site=${WHEEL_SITE:-/tmp/site}
failed=()

run() {  # echo, then run unless --dry-run
  echo "+ $*"
  [[ $mode == dry ]] || "$@"
}

[[ $mode == dry ]] || mkdir -p "$out"
start=$SECONDS

# 1. TorchRec from the carried wheels when it is not importable (the GPU machine has no index).
if [[ -d .whl ]] && ! "$PY" -c "import torchrec" 2>/dev/null; then
  run "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" .whl/*.whl \
    || { echo "gpu_check.sh: installing .whl/*.whl failed" >&2; exit 1; }
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
echo "PYTHONPATH=$PYTHONPATH"

# 2. The extension, built in place against this machine's torch (CUDA kernels when torch has CUDA + nvcc).
echo "+ $PY setup.py build_ext --inplace > $out/build.log"
if [[ $mode != dry ]]; then
  if ! "$PY" setup.py build_ext --inplace > "$out/build.log" 2>&1; then
    tail -30 "$out/build.log"; echo "gpu_check.sh: build failed (see $out/build.log)" >&2; exit 1
  fi
  grep "^torchrec_ext:" "$out/build.log"  # which kernels it built
  "$PY" -c "import pytest" 2>/dev/null || {
    echo "gpu_check.sh: pytest is not importable with $PY (add its wheels to .whl/: pip download pytest -d .whl)" >&2; exit 1; }
fi

# 3. The whole test suite (CUDA variants run when the GPU and the CUDA build are there), every
# case of the matrices CI runs a covering subset of (tests/matrix.py). The GPU tier's tests
# (tiered tables with the cache in HBM: tests/test_tiers_device.py) first, in a report of their own.
export TORCHREC_EXT_FULL_MATRIX=1
if [[ $mode == cpu ]]; then
  run "$PY" -m pytest tests -q --collect-only | tail -3
else
  echo "+ $PY -m pytest tests/test_tiers_device.py -q -rs | tee $out/gpu_tier_tests.txt"
  if [[ $mode != dry ]]; then
    "$PY" -m pytest tests/test_tiers_device.py -q -rs 2>&1 | tee "$out/gpu_tier_tests.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("tier tests")
  fi
  echo "+ $PY -m pytest tests -q -rs --junitxml=$out/gpu_tests.xml | tee $out/gpu_tests.txt"
  if [[ $mode != dry ]]; then
    "$PY" -m pytest tests -q -rs --junitxml="$out/gpu_tests.xml" 2>&1 | tee "$out/gpu_tests.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("tests")
  fi
fi

# 4. Syncs, profile, bandwidth and the GPU benchmarks (each step reported; one failing does not stop the rest).
if [[ $mode == cpu ]]; then
  run "$PY" benchmarks/gpu_check.py --out-dir "$out" --device cpu --smoke || failed+=("gpu_check.py")
else
  run "$PY" benchmarks/gpu_check.py --out-dir "$out" || failed+=("gpu_check.py")
fi

echo "gpu_check.sh: $((SECONDS - start)) s; report $out/gpu_check.md, tests $out/gpu_tests.txt"
if (( ${#failed[@]} )); then
  echo "gpu_check.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
