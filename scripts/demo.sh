#!/usr/bin/env bash
# The demo training run, from a fresh machine with only Python 3.11: set-up, then train.
# Extra arguments go to examples/gpt/train.py (e.g. `--steps 50`, `--device cuda`, `--help`).
# $FUNSHARD_PY names an interpreter that already has torch and optree (a GPU machine's own):
# then no set-up runs and that interpreter trains.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${FUNSHARD_PY:-}" ]; then
  PY="$FUNSHARD_PY"
else
  FUNSHARD_EXTRAS=demo bash scripts/setup.sh
  PY=.venv/bin/python
fi
exec "$PY" examples/gpt/train.py "$@"
