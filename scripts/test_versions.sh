#!/usr/bin/env bash
# Opt-in (not CI's): the whole test suite against an older torch + TorchRec than CI's torch 2.13 +
# TorchRec 1.8, the range pyproject.toml supports (issue 13, item 9):
#
#   bash scripts/test_versions.sh 2.11 [pytest args]   # torch 2.11.0, fbgemm-gpu-cpu 1.6.0, TorchRec 1.6.1
#   bash scripts/test_versions.sh 2.12 [pytest args]   # torch 2.12.1, fbgemm-gpu-cpu 1.7.0, TorchRec 1.7.0
#
# 2.11 + 1.6.1 is what the lent GPU machine has. The checkout's files are copied to .versions/torch<v>/
# (ignored by git), where scripts/setup.sh makes that copy's .venv with the older set and builds the
# extension against it, so this checkout's own .venv and build stay as they are. PyPI's torch 2.11 and
# 2.12 for Linux are CUDA 13 builds (with their nvidia-* wheels, ~3 GB; they import without a GPU): on a
# machine with the CUDA toolkit (CUDA_HOME, or nvcc on PATH) the CUDA kernels are built too. About
# 5 minutes to set up the first time, then the suite (~12 minutes on 2 cores). Summaries of the runs:
# benchmarks/results/torch_versions_cpu.md.
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
  2.11) torch=2.11.0 fbgemm=1.6.0 torchrec=1.6.1 triton=3.6.0 ;;
  2.12) torch=2.12.1 fbgemm=1.7.0 torchrec=1.7.0 triton=3.7.1 ;;
  *) echo "usage: bash scripts/test_versions.sh 2.11|2.12 [pytest args] (got '${1:-}')" >&2; exit 2 ;;
esac
shift
copy=.versions/torch$torch
mkdir -p "$copy"
# The tracked and new (not ignored) files, as a fresh clone of this working tree would have them.
git ls-files -co --exclude-standard -z | tar --null -cf - -T - | tar -xf - -C "$copy"
cd "$copy"
nvcc_home=$(command -v nvcc >/dev/null && dirname "$(dirname "$(command -v nvcc)")" || true)
if [[ -z ${CUDA_HOME:-} && -n $nvcc_home && ! -f $nvcc_home/include/cuda_runtime_api.h \
  && -f /usr/local/cuda/include/cuda_runtime_api.h ]]; then
  # torch takes the folder above the nvcc on PATH: a wrapper's (/usr/local/bin here), not the toolkit's
  export CUDA_HOME=/usr/local/cuda
fi
TORCHREC_EXT_TORCH=$torch TORCHREC_EXT_FBGEMM=$fbgemm TORCHREC_EXT_TORCHREC=$torchrec TORCHREC_EXT_TRITON=$triton \
  bash scripts/setup.sh
echo "test_versions: torch $torch, fbgemm-gpu-cpu $fbgemm, TorchRec $torchrec, in $copy"
exec .venv/bin/python -m pytest tests -q -p no:cacheprovider "$@"
