#!/usr/bin/env bash
# Sets up .venv when needed, then runs the main job (for now: the dynamic-table demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m torchrec_ext.demo "$@"
