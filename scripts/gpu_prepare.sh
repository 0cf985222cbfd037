#!/usr/bin/env bash
# Here, before a session's first device call (the lent GPU machine has no network): everything the
# GPU check carries, in one command. Run from anywhere; the files land in the checkout.
#
#   bash scripts/gpu_prepare.sh [--dry-run] [--no-fbgemm]
#
# 1. .whl/: torchrec, fbgemm-gpu-cpu, tensordict and their missing needs (the wheels script beside
#    the checkout, WHEELS_SCRIPT, default ../shared/gpu/wheels.sh), pytest and pytest-xdist;
# 2. .whl/lookup_before_*.py: the pooled-lookup kernel before 7a37695, 42544ae and eab9927 (the A/B
#    steps of benchmarks/results/gpu/issue13_audit.md's runbook);
# 3. .fbgemm/: fbgemm-gpu's CUDA build slimmed to sm_90 in parts (scripts/fbgemm_cuda_parts.py),
#    unless --no-fbgemm or a pack of the same version and slimming is already there.
# Then it prints what each of the two device calls carries. PYTHON: the interpreter that downloads
# (default .venv/bin/python, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
dry=0
fbgemm=1
for arg in "$@"; do
  case "$arg" in
    --dry-run) dry=1 ;;
    --no-fbgemm) fbgemm=0 ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_prepare.sh: unknown argument $arg" >&2; exit 2 ;;
  esac
done
PY=${PYTHON:-$( [[ -x .venv/bin/python ]] && echo .venv/bin/python || echo python3 )}
wheels=${WHEELS_SCRIPT:-../shared/gpu/wheels.sh}
run() {
  echo "+ $*"
  (( dry )) || "$@"
}

[[ -f $wheels ]] || { echo "gpu_prepare.sh: no wheels script at $wheels (set WHEELS_SCRIPT)" >&2; exit 2; }
run bash "$wheels"
run "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
  pytest pluggy iniconfig pytest-xdist execnet
for commit in 7a37695 42544ae eab9927; do
  echo "+ git show $commit~1:torchrec_ext/triton_kernels/embedding_lookup.py > .whl/lookup_before_$commit.py"
  (( dry )) || git show "$commit~1:torchrec_ext/triton_kernels/embedding_lookup.py" > ".whl/lookup_before_$commit.py"
done
if (( fbgemm )); then
  # (a pack from before the compacting slimming, session 21, has no "cubins_kept": made again)
  if [[ -f .fbgemm/MANIFEST.json ]] && grep -q '"wheel": "fbgemm_gpu-1.6.0-' .fbgemm/MANIFEST.json \
    && grep -q '"cubins_kept"' .fbgemm/MANIFEST.json; then
    echo "gpu_prepare.sh: .fbgemm/ already holds fbgemm-gpu 1.6.0's parts"
  else
    run "$PY" scripts/fbgemm_cuda_parts.py pack
  fi
fi
if [[ -f .fbgemm/MANIFEST.json ]]; then  # one part a call, the calls back to back (the machine keeps earlier parts while warm)
  "$PY" - <<'PYEOF'
import json
parts = [p["name"] for p in json.load(open(".fbgemm/MANIFEST.json"))["parts"]]
for k, name in enumerate(parts, 1):
    print(f"gpu_prepare.sh: device call {k} carries [\".whl\", \".fbgemm/MANIFEST.json\", \".fbgemm/{name}\"]"
          + (" (the tests: --tests-only)" if k == 1 else "") + (" (the benchmarks: --bench-only)" if k == len(parts) else ""))
PYEOF
else
  echo "gpu_prepare.sh: every device call carries [\".whl\"] (no fbgemm CUDA parts: TorchRec's CUDA baselines not runnable)"
fi
