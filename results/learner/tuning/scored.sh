#!/usr/bin/env bash
# The setting the tuning stream picked (run.sh), scored on the two shift streams it never read:
# 200 SQL prompts of DB-GPT's examples and 160 HumanEval prompts (bench/configs/shift_sql_200.yaml),
# the draft's window as served (128 tokens). NAME=steps: the learner's steps a round (base: 2, the
# setting before). One thread each, two at a time.
#   bash results/learner/tuning/scored.sh RUN ...   RUN: sql:STEPS or code:STEPS (base 2 adds the static adapter)
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/learner/tuning/scored
run() {
  local stream=${1%%:*} steps=${1##*:} methods=online extra=()
  [ "$steps" = 2 ] && methods=static,online
  [ "$stream" = code ] && extra=(--sources humaneval --domains code --order code --n 160)
  HF_HUB_OFFLINE=1 ${PYTHON:-.venv/bin/python} -m osd.cli experiment shift --config bench/configs/shift_sql_200.yaml \
    "${extra[@]}" --draft-context 128 --steps-per-round "$steps" --methods $methods --threads 1 --quiet \
    --json "$OUT/${stream}_s$steps.json" --png "$OUT/${stream}_s$steps.png" > "$OUT/${stream}_s$steps.log" 2>&1
}
i=0
for r in "$@"; do
  run "$r" & i=$((i + 1))
  if [ $((i % 2)) -eq 0 ]; then wait; fi
done
wait
