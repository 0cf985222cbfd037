#!/usr/bin/env bash
# Sets up .venv when needed, lints, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
bash scripts/lint.sh  # the house rules (ruff, ruff format, clang-format): a few seconds, before the tests
exec .venv/bin/python -m pytest tests -q "$@"
