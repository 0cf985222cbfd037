#!/usr/bin/env bash
# Sets up .venv when needed, then runs the main job: DLRM_DCN on dynamic embedding tables,
# trained on synthetic Criteo-like data in one process (python -m torchrec_ext.train --help for
# its flags; extra arguments are passed on). Output: runs/<timestamp>/{summary.json,curves.png}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m torchrec_ext.train "$@"
