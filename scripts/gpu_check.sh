#!/usr/bin/env bash
# One command on a GPU machine (torch + triton importable; torchrec + fbgemm-gpu[-cpu] importable or
# their wheels in .whl/): builds the CUDA extension in place, runs the whole test suite (CUDA variants
# included), then benchmarks/gpu_check.py (host syncs of a training step, a one-step profile, pooled
# lookup GB/s vs copy bandwidth, the GPU benchmarks). No venv is created.
#
#   bash scripts/gpu_check.sh [OUT_DIR] [--dry-run | --cpu-smoke] [--tests-only | --bench-only | --tests-part K/N]
#
# OUT_DIR (default benchmarks/results/) gets build.log, gpu_tier_tests.txt, gpu_tests.txt + gpu_tests.xml
# (junit), gpu_check.md (the report), gpu_check.jsonl (one JSON row per step) and each benchmark's
# results (tiers_gpu.md: the tiered tables vs TorchRec's UVM caching).
# --dry-run prints the commands without running them; --cpu-smoke runs the build and the driver at
# tiny sizes on the CPU (checks the pytest invocation with --collect-only instead of running it).
# The whole check does not fit one 10-minute call: split it. --tests-only: build + tests, no benchmarks;
# --bench-only: build + benchmarks/gpu_check.py, no tests; --tests-part K/N: build + part K of N
# disjoint parts of the suite (tests/parts.py; every test in exactly one part), reported in
# gpu_tests_partK.txt/.xml, no benchmarks. E.g. --tests-part 1/3, 2/3, 3/3, then --bench-only.
# Exit status: non-zero when the build, any test or any step of the driver failed.
# Environment: PYTHON (default python3), CUDA_HOME / TORCH_CUDA_ARCH_LIST (read by setup.py: sm_90 +
# compute_90 PTX by default), WHEEL_SITE (where .whl/ is installed, default /tmp/site), PYTEST_ARGS
# (more pytest arguments, split on spaces), PYTEST_WORKERS (pytest-xdist processes; default: half the
# cores, at most 8, when pytest-xdist is importable; 0 runs the tests in this process; the suite is
# xdist-safe: every test's files, ports and process groups are its own), FBGEMM_PARTS (default
# .fbgemm/: fbgemm-gpu's CUDA build in parts, scripts/fbgemm_cuda_parts.py) and FBGEMM_CUDA_SITE
# (where they are unpacked, default /tmp/fbgemm_cuda).
set -uo pipefail
cd "$(dirname "$0")/.."

out=benchmarks/results
mode=gpu
steps=all  # all | tests | bench | part
part=
while (( $# )); do
  case "$1" in
    --dry-run) mode=dry ;;
    --cpu-smoke) mode=cpu ;;
    --tests-only) steps=tests ;;
    --bench-only) steps=bench ;;
    --tests-part)
      [[ $# -ge 2 ]] || { echo "gpu_check.sh: --tests-part needs K/N" >&2; exit 2; }
      part=$2; steps=part; shift ;;
    --tests-part=*) part=${1#*=}; steps=part ;;
    -h|--help) sed -n '2,27p' "$0"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $1" >&2; exit 2 ;;
    *) out=$1 ;;
  esac
  shift
done
if [[ $steps == part ]]; then
  if ! [[ $part =~ ^([0-9]+)/([0-9]+)$ ]] || (( BASH_REMATCH[1] < 1 || BASH_REMATCH[1] > BASH_REMATCH[2] )); then
    echo "gpu_check.sh: --tests-part must be K/N with 1 <= K <= N, got '$part'" >&2; exit 2
  fi
  part_k=${BASH_REMATCH[1]}
fi
read -r -a pytest_extra <<< "${PYTEST_ARGS:-}"
PY=${PYTHON:-python3}
workers=${PYTEST_WORKERS:-auto}
if ! [[ $workers =~ ^(auto|[0-9]+)$ ]]; then
  echo "gpu_check.sh: PYTEST_WORKERS must be a count or auto, got '$workers'" >&2; exit 2
fi
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
# fbgemm's CUDA build, when its parts were carried (scripts/fbgemm_cuda_parts.py: one part a call, the
# machine keeping earlier ones while warm), goes first: TorchRec's own tables then run on the GPU (the
# benchmarks' TorchRec baselines). Until every part is here, fbgemm-gpu-cpu stays and those are not runnable.
parts=${FBGEMM_PARTS:-.fbgemm}
if [[ -f $parts/MANIFEST.json ]]; then
  fbgemm_site=${FBGEMM_CUDA_SITE:-/tmp/fbgemm_cuda}
  run "$PY" scripts/fbgemm_cuda_parts.py unpack --dir "$parts" --target "$fbgemm_site"
  case $? in
    0) export PYTHONPATH="$fbgemm_site${PYTHONPATH:+:$PYTHONPATH}" ;;
    3) ;;  # parts still to come (named above): fbgemm-gpu-cpu stays
    *) failed+=("unpacking fbgemm's CUDA parts") ;;
  esac
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

# The suite across processes (pytest-xdist) unless told otherwise: a CUDA test owns no more than
# its process (memory caps are per process), so 8 workers share one GPU. The CPU smoke only collects.
if [[ $workers == auto ]]; then
  workers=0
  if [[ $mode != cpu ]] && "$PY" -c "import xdist" 2>/dev/null; then
    workers=$(( $(nproc) / 2 )); (( workers <= 8 )) || workers=8
  fi
fi
if (( workers > 1 )) && ! [[ " ${pytest_extra[*]-} " =~ " -n " || " ${pytest_extra[*]-} " =~ " --numprocesses" ]]; then
  pytest_extra+=(-n "$workers")
fi

# 3. The whole test suite (CUDA variants run when the GPU and the CUDA build are there), every
# case of the matrices CI runs a covering subset of (tests/matrix.py). The GPU tier's tests
# (tiered tables with the cache in HBM: tests/test_tiers_device.py) first, in a report of their own.
# With --tests-part, only that part of the suite (the tier tests among them when they fall in it).
export TORCHREC_EXT_FULL_MATRIX=1
if [[ $steps == part ]]; then
  select=(--tests-part "$part"); report=gpu_tests_part$part_k
else
  select=(); report=gpu_tests
fi
if [[ $steps == bench ]]; then
  :
elif [[ $mode == cpu ]]; then
  run "$PY" -m pytest tests -q --collect-only ${select[@]+"${select[@]}"} ${pytest_extra[@]+"${pytest_extra[@]}"} | tail -3
  [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("test collection")
else
  if [[ $steps != part ]]; then
    echo "+ $PY -m pytest tests/test_tiers_device.py -q -rs ${pytest_extra[*]} | tee $out/gpu_tier_tests.txt"
    if [[ $mode != dry ]]; then
      "$PY" -m pytest tests/test_tiers_device.py -q -rs ${pytest_extra[@]+"${pytest_extra[@]}"} 2>&1 | tee "$out/gpu_tier_tests.txt"
      [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("tier tests")
    fi
  fi
  if [[ $steps != part ]]; then select=(--ignore=tests/test_tiers_device.py); fi  # they ran just above
  echo "+ $PY -m pytest tests -q -rs ${select[*]} ${pytest_extra[*]} --junitxml=$out/$report.xml | tee $out/$report.txt"
  if [[ $mode != dry ]]; then
    "$PY" -m pytest tests -q -rs ${select[@]+"${select[@]}"} ${pytest_extra[@]+"${pytest_extra[@]}"} --junitxml="$out/$report.xml" 2>&1 | tee "$out/$report.txt"
    [[ ${PIPESTATUS[0]} == 0 ]] || failed+=("tests${part:+ part $part}")
  fi
fi

# 4. Syncs, profile, bandwidth and the GPU benchmarks (each step reported; one failing does not stop the rest).
if [[ $steps == tests || $steps == part ]]; then
  :
elif [[ $mode == cpu ]]; then
  run "$PY" benchmarks/gpu_check.py --out-dir "$out" --device cpu --smoke || failed+=("gpu_check.py")
else
  run "$PY" benchmarks/gpu_check.py --out-dir "$out" || failed+=("gpu_check.py")
fi

case $steps in
  all) echo "gpu_check.sh: $((SECONDS - start)) s; report $out/gpu_check.md, tests $out/$report.txt" ;;
  bench) echo "gpu_check.sh: $((SECONDS - start)) s; report $out/gpu_check.md (no tests run)" ;;
  *) echo "gpu_check.sh: $((SECONDS - start)) s; tests $out/$report.txt (no benchmarks run)" ;;
esac
if (( ${#failed[@]} )); then
  echo "gpu_check.sh: FAILED: ${failed[*]}" >&2
  exit 1
fi
