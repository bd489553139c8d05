#!/usr/bin/env bash
# Create or reuse a virtual environment, install torch 2.13.0 (the CPU build) when it has no
# torch, then funshard editable with the extras named in $FUNSHARD_EXTRAS (default: test).
#
#   bash scripts/setup.sh             # what scripts/demo.sh and scripts/test.sh run first
#   bash scripts/setup.sh --dry-run   # say what it would do, change nothing
#
# Where torch comes from, in this order:
#   1. a local wheel folder ($FUNSHARD_WHEELS, else $PIP_FIND_LINKS, else /opt/wheels) that
#      holds a torch-2.13.0+cpu wheel: that wheel, pinned as 2.13.0+cpu;
#   2. otherwise the PyTorch CPU index, as PyTorch documents it:
#      pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu
# Never a bare `pip install torch` from PyPI, whose Linux build pulls the CUDA libraries.
# torch goes in first and alone; funshard's own install then finds it already satisfied.
# $FUNSHARD_VENV (default .venv) and $PYTHON (default python3.11, else python3) choose the
# environment and the interpreter that creates it.
set -euo pipefail
cd "$(dirname "$0")/.."

DRY=0
case "${1:-}" in
  --dry-run) DRY=1 ;;
  "") ;;
  -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
  *) echo "setup.sh: unknown argument '$1' (use --dry-run or --help)" >&2; exit 2 ;;
esac

TORCH_VERSION=2.13.0
CPU_INDEX=https://download.pytorch.org/whl/cpu
VENV="${FUNSHARD_VENV:-.venv}"
PY="${PYTHON:-$(command -v python3.11 || command -v python3)}"
EXTRAS="${FUNSHARD_EXTRAS:-test}"

say() { echo "setup: $*"; }
run() {
  echo "+ $*"
  if [ "$DRY" -eq 0 ]; then "$@"; fi
}

if [ -x "$VENV/bin/python" ]; then
  say "reusing $VENV ($("$VENV/bin/python" --version 2>&1))"
else
  say "creating $VENV with $PY ($("$PY" --version 2>&1))"
  run "$PY" -m venv "$VENV"
fi

have_torch=""
if [ -x "$VENV/bin/python" ]; then
  have_torch="$("$VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null || true)"
fi
if [ -n "$have_torch" ]; then
  say "torch $have_torch is already in $VENV: not installing torch"
else
  WHEELS="${FUNSHARD_WHEELS:-${PIP_FIND_LINKS:-/opt/wheels}}"
  if compgen -G "$WHEELS/torch-$TORCH_VERSION+cpu-*.whl" >/dev/null; then
    say "installing torch $TORCH_VERSION+cpu from the local wheel folder $WHEELS"
    run "$VENV/bin/pip" install --quiet --find-links "$WHEELS" "torch==$TORCH_VERSION+cpu"
  else
    say "no torch $TORCH_VERSION wheel in a local folder ($WHEELS): installing the CPU build"
    say "of torch $TORCH_VERSION from the PyTorch CPU index $CPU_INDEX (about 200 MB, no CUDA)"
    run "$VENV/bin/pip" install --quiet "torch==$TORCH_VERSION" --index-url "$CPU_INDEX"
  fi
fi

STAMP="$VENV/.funshard-installed-$EXTRAS"
if [ ! -f "$STAMP" ] || [ pyproject.toml -nt "$STAMP" ]; then
  say "installing funshard (editable) with the extras [$EXTRAS] from PyPI"
  run "$VENV/bin/pip" install --quiet -e ".[$EXTRAS]"
  run touch "$STAMP"
else
  say "funshard [$EXTRAS] is installed in $VENV (pyproject.toml unchanged)"
fi
if [ "$DRY" -eq 1 ]; then
  say "dry run: nothing was changed"
fi
