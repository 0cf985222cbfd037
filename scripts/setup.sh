#!/usr/bin/env bash
# Sets up .venv in the checkout: pinned torch, the fbgemm variant matching the machine,
# torchrec without its declared deps (it names the 500 MB CUDA fbgemm-gpu) plus its real
# deps, triton, torchx, pytest, and this package in editable mode built against that torch.
# Idempotent: a second run checks the stamp and only rebuilds the extension if sources changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCHREC_EXT_VENV:-.venv}
TORCH_VERSION=2.13.0
FBGEMM_VERSION=1.8.0
TORCHREC_VERSION=1.8.0
STAMP="$VENV/.torchrec_ext_deps_v1"

if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"

if [ ! -f "$STAMP" ]; then
  "$PY" -m pip install -q --upgrade pip setuptools wheel ninja
  # An unpinned torch pulls the newest CUDA build (GBs); pin it first so nothing upgrades it.
  "$PY" -m pip install -q "torch==$TORCH_VERSION"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    FBGEMM="fbgemm-gpu==$FBGEMM_VERSION"
  else
    FBGEMM="fbgemm-gpu-cpu==$FBGEMM_VERSION"
  fi
  "$PY" -m pip install -q "$FBGEMM" "torch==$TORCH_VERSION"
  "$PY" -m pip install -q --no-deps "torchrec==$TORCHREC_VERSION"
  "$PY" -m pip install -q "torch==$TORCH_VERSION" tensordict "torchmetrics==1.0.3" tqdm \
      pyre-extensions typing-inspect iopath "triton==3.6.0" "torchx==0.7.0" pytest numpy matplotlib
  touch "$STAMP"
fi

# Editable install of this package, compiled against the venv's torch (no build isolation,
# so the extension's ABI matches the torch that will load it).
"$PY" -m pip install -q --no-build-isolation --no-deps -e .
