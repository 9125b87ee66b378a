#!/usr/bin/env bash
# The learner's round settings chosen on a tuning stream that is never scored: 120 prompts of two
# sources and domains no draft was distilled on (anagrams to solve, then words to spell backwards, from
# bench/data/open.jsonl), one draft learning across the shift, from the shipped adapter, the draft's
# window as served (128 tokens). STREAM=prose: 166 prompts of quotes, Verne's fiction and pyjokes instead
# (output under prose/), where no setting learned anything. Each setting runs the stream once (online
# only; the static adapter once, with base).
#   bash results/learner/tuning/run.sh [NAME ...]      (default: every setting)
# Then the setting picked, scored on the two shift streams the tuning never reads: 200 SQL prompts of
# DB-GPT's examples and 160 HumanEval prompts (bench/configs/shift_sql_200.yaml), output under scored/:
#   bash results/learner/tuning/run.sh score RUN ...   RUN: sql:STEPS or code:STEPS (STEPS 2 adds the static adapter)
# Two runs at a time, one thread each.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/learner/tuning
STREAMARGS="--sources anagrams words --domains anagrams spelling --order anagrams,spelling --n 120"
if [ "${STREAM:-}" = prose ]; then
  OUT=$OUT/prose
  STREAMARGS="--sources quotes verne-2889 pyjokes --domains quotes fiction jokes --order quotes,fiction,jokes --n 166"
fi
declare -A SET=(
  [base]="--steps-per-round 2 --lr 1e-3 --train-every 16"
  [s4]="--steps-per-round 4 --lr 1e-3 --train-every 16"
  [s8]="--steps-per-round 8 --lr 1e-3 --train-every 16"
  [lr2]="--steps-per-round 2 --lr 2e-3 --train-every 16"
  [s4lr2]="--steps-per-round 4 --lr 2e-3 --train-every 16"
  [e8]="--steps-per-round 2 --lr 1e-3 --train-every 8"
  [s16]="--steps-per-round 16 --lr 1e-3 --train-every 16"
  [s8lr2]="--steps-per-round 8 --lr 2e-3 --train-every 16"
  [s32]="--steps-per-round 32 --lr 1e-3 --train-every 16"
  [s16lr2]="--steps-per-round 16 --lr 2e-3 --train-every 16"
  [s16b32]="--steps-per-round 16 --lr 1e-3 --train-every 16 --batch-records 32"
)
osd_shift() { HF_HUB_OFFLINE=1 ${PYTHON:-.venv/bin/python} -m osd.cli experiment shift --threads 1 --quiet "$@"; }
tune() {
  local name=$1 methods=online; [ "$name" = base ] && methods=static,online
  osd_shift --workload bench/data/open.jsonl $STREAMARGS --max-tokens 32 --k 4 --methods $methods \
    --draft-adapter shipped --adapter-rank 16 --batch-records 16 --gate-margin 0.02 --draft-context 128 \
    --window 20 --fractions 1.0 ${SET[$name]} --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
score() {
  local stream=${1%%:*} steps=${1##*:} methods=online extra=() out=results/learner/tuning/scored
  [ "$steps" = 2 ] && methods=static,online
  [ "$stream" = code ] && extra=(--sources humaneval --domains code --order code --n 160)
  osd_shift --config bench/configs/shift_sql_200.yaml "${extra[@]}" --draft-context 128 --steps-per-round "$steps" \
    --methods $methods --json "$out/${stream}_s$steps.json" --png "$out/${stream}_s$steps.png" > "$out/${stream}_s$steps.log" 2>&1
}
job=tune; [ "${1:-}" = score ] && { job=score; shift; }
names=("$@"); [ ${#names[@]} -eq 0 ] && [ $job = tune ] && names=(base s4 s8 lr2 s4lr2 e8 s16 s8lr2 s32 s16lr2 s16b32)
i=0
for n in "${names[@]}"; do
  $job "$n" & i=$((i + 1))
  if [ $((i % 2)) -eq 0 ]; then wait; fi
done
wait
