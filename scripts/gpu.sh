#!/usr/bin/env bash
# The GPU checks, on a machine with a GPU: every stage's log in one file, $OUT/gpu.log
# (default gpu-results/), with the benchmarks' JSON beside it (three files in all), so one
# or two calls cover them all:
#
#   FUNSHARD_PY=python3 bash scripts/gpu.sh lane      # the CUDA test lane (scripts/test.sh)
#   FUNSHARD_PY=python3 bash scripts/gpu.sh single    # one-GPU table: small and large, fp32, bf16
#   FUNSHARD_PY=python3 bash scripts/gpu.sh floor     # host time: plain, module hooks, lean
#                                                     # stand-ins, funshard (benchmarks/host_floor.py)
#   FUNSHARD_PY=python3 bash scripts/gpu.sh bench     # the default benchmark at world 1, with
#                                                     # the overlap profile (collectives forced)
#   FUNSHARD_PY=python3 bash scripts/gpu.sh compiled  # train_step(compile=True) at world 1:
#                                                     # host-bound GPT, with CUDA graphs, and
#                                                     # with the collectives forced
#   FUNSHARD_PY=python3 bash scripts/gpu.sh demo      # the demo on one GPU, briefly
#   FUNSHARD_PY=python3 bash scripts/gpu.sh all       # every stage, in that order
#   FUNSHARD_PY=python3 bash scripts/gpu.sh lane,compiled   # some stages, in that order
#
# $FUNSHARD_STAGE_CAP (seconds): each stage stopped after that long (exit 124 in the log),
# so that a call with a time limit still reaches its later stages. On one H100 (torch 2.11)
# the stages took about: info 7 s, lane 115, compiled 190+, single 80-130 per table (it has
# four), floor 25, bench 60+, demo 20 (docs/gpus.md): `all` is two calls of a 600 s limit.
#
# $FUNSHARD_PY: the GPU machine's interpreter (torch with CUDA). What it lacks of optree,
# pytest and hypothesis comes from wheels in .whl/ (carried; see docs/gpus.md):
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
#     --implementation cp --platform manylinux_2_28_x86_64 -d .whl optree pytest pluggy \
#     iniconfig packaging hypothesis attrs sortedcontainers
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${FUNSHARD_PY:?set FUNSHARD_PY to the python of the GPU machine}"
OUT="${OUT:-gpu-results}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
# a GPU machine with no package index: what it lacks from a carried wheel folder (.whl/)
missing=""
for m in optree pytest hypothesis; do
  "$PY" -c "import $m" 2>/dev/null || missing="$missing $m"
done
if [ -n "$missing" ] && ls .whl/*.whl >/dev/null 2>&1; then
  echo "gpu.sh: installing the carried wheels (missing:$missing)"
  "$PY" -m pip install -q --no-index --no-deps --target /tmp/funshard-site .whl/*.whl
  export PYTHONPATH="/tmp/funshard-site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
fi

LOG="$OUT/gpu.log"
T0=$(date +%s)

stage() {  # name, command...: the command's output to the terminal and $OUT/gpu.log
  local name="$1"
  shift
  local cap=()
  if [ -n "${FUNSHARD_STAGE_CAP:-}" ]; then cap=(timeout -k 10 "$FUNSHARD_STAGE_CAP"); fi
  echo "== $name: $*" | tee -a "$LOG"
  set +e
  "${cap[@]}" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  set -e
  echo "== $name: exit $rc ($(( $(date +%s) - T0 )) s since gpu.sh began)" | tee -a "$LOG"
  return "$rc"
}

INFO='import torch; c = torch.cuda
print(torch.__version__, torch.version.cuda, c.get_device_name(0), c.device_count(), "GPUs")'

run() {
  case "$1" in
    info) stage info "$PY" -c "$INFO" ;;
    lane) stage lane bash scripts/test.sh --device cuda -q -p no:cacheprovider ;;
    single) stage single "$PY" -m benchmarks.bench --device cuda --single small,large \
              --json "$OUT/single.json" ;;
    floor) stage floor "$PY" -m benchmarks.host_floor --device cuda ;;
    bench) FUNSHARD_FORCE_COLLECTIVES=1 stage bench "$PY" -m benchmarks.bench --device cuda \
             --world 1 --profile funshard_full --json "$OUT/bench.json" ;;
    compiled) local rc=0
              stage compiled "$PY" -m benchmarks.compiled_step --host --device cuda \
                --cudagraphs --rounds 10 || rc=1
              FUNSHARD_FORCE_COLLECTIVES=1 stage compiled_forced "$PY" -m \
                benchmarks.compiled_step --host --device cuda --rounds 10 || rc=1
              return "$rc" ;;
    demo) stage demo bash scripts/demo.sh --device cuda --nproc 1 --mesh 1x1 --steps 60 \
            --no-progress --out "$(mktemp -d)/demo-run" ;;  # its log only: few files in $OUT
    all) local rc=0
         for s in info lane single floor bench compiled demo; do run "$s" || rc=1; done
         return "$rc" ;;
    *) echo "gpu.sh: unknown stage '$1' (info, lane, single, floor, bench, compiled, demo," \
            "all)" >&2; return 2 ;;
  esac
}

export FUNSHARD_PY="$PY"
rc=0
IFS=, read -ra STAGES <<< "${1:-all}"
for s in "${STAGES[@]}"; do
  run "$s" || rc=$?
done
exit "$rc"
