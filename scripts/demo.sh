#!/usr/bin/env bash
# The demo training run, from a fresh machine with only Python 3.11: set-up, then train.
# Extra arguments go to examples/gpt/train.py (e.g. `--steps 50`, `--help`).
set -euo pipefail
cd "$(dirname "$0")/.."
FUNSHARD_EXTRAS=demo bash scripts/setup.sh
exec .venv/bin/python examples/gpt/train.py "$@"
