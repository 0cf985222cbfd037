#!/usr/bin/env bash
# Sets up .venv when needed, then runs the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest tests -q "$@"
