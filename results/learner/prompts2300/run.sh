#!/usr/bin/env bash
# The package's adapter (drafts/starting) trained 1,200 s more on 2,300 prompts: the 1,500 it was
# trained on and the next 800 of the same ten sources, by the same rule (docs/proposers.md, "Half as
# many prompts again"). One run each on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OSD=.venv/bin/osd
R=results/learner/prompts2300
T720=${T720:-/tmp/teacher720.pt}      # the teacher file of "Twice the steps" (results/learner/steps2x/run.sh)
T1500=${T1500:-/tmp/teacher1500.pt}   # that file grown by "Twice the prompts" (results/learner/steps3x/run.sh)
T2300=${T2300:-/tmp/teacher2300.pt}   # a copy of it, grown here by the 800 new prompts
[ -f "$T2300" ] || cp "$T1500" "$T2300"
$OSD distill --adapter-rank 16 --init-adapter shipped --teacher-outputs served --n-prompts 2300 --teacher-cache "$T2300" \
  --out /tmp/more2300 --json $R/more2300_report.json
# on the same 43 held-out prompts as every adapter before (the 720-prompt file ends with them)
.venv/bin/python -m bench.heldout_agreement --teacher-cache "$T720" --heldout 43 --adapters shipped /tmp/more2300 | tee $R/heldout.txt
for f in workload open; do
  $OSD bench --max-tokens 48 --fixed-k 4 --methods spec --draft truncated --n 240 --draft-adapter /tmp/more2300 \
    --workload bench/data/$f.jsonl --threads 1 --json $R/more2300_${f}240.json &
done
wait
