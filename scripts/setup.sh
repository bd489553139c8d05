#!/usr/bin/env bash
# Create or reuse .venv, install torch 2.13.0 (CPU wheel) when no torch is present, then
# funshard editable with the extras named in $FUNSHARD_EXTRAS (default: test).
# torch goes in first and alone, so that nothing resolves a bare `torch` to a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
  # The CPU wheel lies on disk here (PIP_FIND_LINKS); name the folder too in case the
  # variable is not set, so pip never falls back to the registry's CUDA build.
  FIND=()
  [ -d /opt/wheels ] && FIND=(--find-links /opt/wheels)
  .venv/bin/pip install --quiet "${FIND[@]}" "torch==2.13.0"
fi
EXTRAS="${FUNSHARD_EXTRAS:-test}"
STAMP=".venv/.funshard-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  .venv/bin/pip install --quiet -e ".[$EXTRAS]"
  touch "$STAMP"
fi
