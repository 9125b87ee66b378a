#!/usr/bin/env bash
# Does the online learner gain from the target's rows over the prompt's last positions
# (bench/prompt_rows.py)? Measured on tuning streams that are never scored, from the shipped
# adapter, at the server's learner settings (16 steps a round, the draft's 128-token window); each
# stream with and without the rows, one run each, two at a time on one thread each. Written up in
# docs/proposers.md ("The prompt's own positions, online").
#   bash results/learner/prompt_rows/run.sh [NAME ...]
set -euo pipefail
cd "$(dirname "$0")/../../.."
OUT=results/learner/prompt_rows
SHORT="--sources anagrams words --domains anagrams spelling --order anagrams,spelling --n 120"  # 42-token prompts
LONG="--sources codeio gsm-symbolic --domains code math --order code,math --n 120"             # 422 and 90 tokens
declare -A RUN=(
  [short_base]="0 static,online $SHORT"
  [short_w64]="64 online $SHORT"
  [long_base]="0 static,online $LONG"
  [long_w128]="128 online $LONG"
  [long_s2]="0 online $LONG --steps-per-round 2"   # the rounds of 2 steps the server took before
  [long_s8]="0 online $LONG --steps-per-round 8"
  [short_s8]="0 online $SHORT --steps-per-round 8"
)
one() {
  set -- $1 ${RUN[$1]}
  local name=$1 rows=$2 methods=$3; shift 3
  HF_HUB_OFFLINE=1 ${PYTHON:-.venv/bin/python} -m bench.prompt_rows --rows "$rows" --threads 1 --quiet \
    --workload bench/data/open.jsonl --max-tokens 32 --k 4 --methods "$methods" --draft-adapter shipped \
    --adapter-rank 16 --batch-records 16 --gate-margin 0.02 --draft-context 128 --window 20 --fractions 1.0 \
    --steps-per-round 16 --lr 1e-3 --train-every 16 "$@" --json "$OUT/$name.json" > "$OUT/$name.log" 2>&1
}
names=("$@"); [ ${#names[@]} -eq 0 ] && names=(short_base short_w64 long_base long_w128)
i=0
for n in "${names[@]}"; do
  one "$n" & i=$((i + 1))
  if [ $((i % 2)) -eq 0 ]; then wait; fi
done
wait
