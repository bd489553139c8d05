#!/usr/bin/env bash
# The whole test suite, from a fresh machine with only Python 3.11: set-up, then pytest.
# Extra arguments go to pytest (e.g. `bash scripts/test.sh tests/test_shard.py -x`).
#
#   bash scripts/test.sh                   # everything, on the CPU (gloo ranks): what CI runs
#   bash scripts/test.sh --device cuda     # the CUDA lane: the tests marked `lane` on GPUs
#                                          # (NCCL; world 1 with every collective forced),
#                                          # multi-rank ones where there are enough GPUs
# --device cuda where torch sees no GPU fails (exit 3) rather than skip everything.
# $FUNSHARD_PY names an interpreter that already has torch and the test packages (a GPU
# machine's own): then no set-up runs and that interpreter runs pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--device" ]; then
  case "${2:-}" in
    cpu|cuda) export FUNSHARD_TEST_DEVICE="$2" ;;
    *) echo "test.sh: --device takes cpu or cuda, got '${2:-}'" >&2; exit 2 ;;
  esac
  shift 2
  if [ "$FUNSHARD_TEST_DEVICE" = "cuda" ]; then
    export FUNSHARD_FORCE_COLLECTIVES=1  # one GPU is a world of one: run its collectives
    set -- -m lane -rs "$@"              # the lane's tests; say why each other one skips
  fi
fi
if [ -n "${FUNSHARD_PY:-}" ]; then
  PY="$FUNSHARD_PY"
else
  FUNSHARD_EXTRAS=test bash scripts/setup.sh
  PY=.venv/bin/python
fi
if [ "${FUNSHARD_TEST_DEVICE:-}" = "cuda" ] && [ -z "${FUNSHARD_LANE_NO_GPU_OK:-}" ] &&
   ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
  # every lane test would skip and pytest would exit 0: that is no CUDA run
  echo "test.sh --device cuda: $PY's torch ($("$PY" -c 'import torch; print(torch.__version__)'))" \
       "sees no CUDA GPU. Run it on a GPU machine with FUNSHARD_PY set to that machine's" \
       "python (FUNSHARD_LANE_NO_GPU_OK=1 only lists the skips)" >&2
  exit 3
fi
set +e
"$PY" -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "no tests were collected" >&2
fi
exit "$rc"
