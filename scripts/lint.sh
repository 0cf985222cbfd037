#!/usr/bin/env bash
# Lints the checkout with the pinned tools scripts/setup.sh installs into .venv (a few seconds):
# ruff check and ruff format --check on the Python files (config: pyproject.toml), clang-format
# on csrc/ (config: .clang-format). Exit status non-zero when any of them finds something.
# Fix with: .venv/bin/ruff check --fix . && .venv/bin/ruff format . && .venv/bin/clang-format -i csrc/*
set -uo pipefail
cd "$(dirname "$0")/.."
VENV=${TORCHREC_EXT_VENV:-.venv}
if [ ! -x "$VENV/bin/ruff" ] || [ ! -x "$VENV/bin/clang-format" ]; then
  bash scripts/setup.sh || exit
fi
status=0
"$VENV/bin/ruff" check . || status=1
"$VENV/bin/ruff" format --check . || status=1
"$VENV/bin/clang-format" --dry-run --Werror csrc/*.cpp csrc/*.cu csrc/*.cuh csrc/*.h || status=1
[ "$status" -eq 0 ] && echo "lint: clean"
exit "$status"
