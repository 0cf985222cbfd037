#!/usr/bin/env bash
# Sets up .venv in the checkout: pinned torch, the fbgemm variant matching the machine,
# torchrec without its declared deps (it names the 500 MB CUDA fbgemm-gpu) plus its real deps,
# triton, torchx, pytest, tensorboard (the job's --tensorboard), the linters (ruff, clang-format for scripts/lint.sh),
# cuobjdump (a 0.3 MB wheel: tests/test_fbgemm_cuda_parts.py reads slimmed device code with it), and this package
# in editable mode built against that torch.
# Idempotent: dependencies install once (stamp file); the extension rebuilds when its sources change.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCHREC_EXT_VENV:-.venv}
# CI's set; scripts/test_versions.sh sets the older pairs (fbgemm releases pair with one torch).
TORCH_VERSION=${TORCHREC_EXT_TORCH:-2.13.0}
FBGEMM_VERSION=${TORCHREC_EXT_FBGEMM:-1.8.0}
TORCHREC_VERSION=${TORCHREC_EXT_TORCHREC:-1.8.0}
TRITON_VERSION=${TORCHREC_EXT_TRITON:-3.6.0}
RUFF_VERSION=0.17.6          # scripts/lint.sh and .pre-commit-config.yaml use these two
CLANG_FORMAT_VERSION=23.1.5
CUOBJDUMP_VERSION=13.5.37    # NVIDIA's reader of device code: the check of scripts/fatbin.py's slimming
DEPS_STAMP="$VENV/.torchrec_ext_deps_v4_torch$TORCH_VERSION"  # bump v4 when the list below changes
BUILD_STAMP="$VENV/.torchrec_ext_build"

pip_install() {
  # This machine's pip config names local mirrors that may be absent; keep their warnings out.
  "$VENV/bin/python" -m pip install -q "$@" 2> >(grep -v "^WARNING: Location" >&2)
}

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  python3 -m venv "$VENV"
fi

if [ ! -f "$DEPS_STAMP" ]; then
  echo "setup: installing torch $TORCH_VERSION, fbgemm, torchrec $TORCHREC_VERSION and friends"
  pip_install --upgrade pip setuptools wheel ninja
  # An unpinned torch pulls the newest CUDA build (GBs): pin it, and repeat the pin below so
  # no later install can move it.
  pip_install "torch==$TORCH_VERSION"
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    fbgemm="fbgemm-gpu==$FBGEMM_VERSION"
  else
    fbgemm="fbgemm-gpu-cpu==$FBGEMM_VERSION"
  fi
  pip_install "$fbgemm" "torch==$TORCH_VERSION"
  pip_install --no-deps "torchrec==$TORCHREC_VERSION"
  pip_install "torch==$TORCH_VERSION" tensordict "torchmetrics==1.0.3" tqdm pyre-extensions \
    typing-inspect iopath "triton==$TRITON_VERSION" "torchx==0.7.0" pytest numpy matplotlib tensorboard \
    "ruff==$RUFF_VERSION" "clang-format==$CLANG_FORMAT_VERSION" "nvidia-cuda-cuobjdump==$CUOBJDUMP_VERSION"
  touch "$DEPS_STAMP"
fi

# Editable install compiled against the venv's torch (no build isolation, so the extension's
# ABI matches the torch that loads it); skipped when sources are unchanged since the last build.
sources_hash=$(cat setup.py pyproject.toml csrc/* | sha256sum | cut -d' ' -f1)
if [ "$(cat "$BUILD_STAMP" 2>/dev/null)" != "$sources_hash" ] || ! "$VENV/bin/python" -c "import torchrec_ext" 2>/dev/null; then
  echo "setup: building torchrec_ext"
  pip_install --no-build-isolation --no-deps -e .
  echo "$sources_hash" > "$BUILD_STAMP"
  "$VENV/bin/python" -c "import torch; from torchrec_ext import ops; \
print('setup: torchrec_ext built with', 'CPU + CUDA' if ops.has_kernel('hash_find', torch.device('cuda')) else 'CPU-only', 'kernels')"
fi
