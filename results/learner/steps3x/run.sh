#!/usr/bin/env bash
# The package's adapter (drafts/starting, "twice the steps") trained 1,200 s more, once on the same
# 720 prompts and once on 1,500 (the 720 and 780 more of the same sources and recipe), and what
# bfloat16 autocast does to a step (docs/proposers.md, "Twice the prompts" and "A bfloat16 forward"). One run each on a 2-core CPU.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OSD=.venv/bin/osd
R=results/learner/steps3x
T720=${T720:-/tmp/teacher720.pt}    # the teacher file of "Twice the steps" (results/learner/steps2x/run.sh)
T1500=${T1500:-/tmp/teacher1500.pt} # a copy of it, grown by the second run's 780 new prompts
[ -f "$T1500" ] || cp "$T720" "$T1500"
$OSD distill --adapter-rank 16 --init-adapter shipped --teacher-outputs served --teacher-cache "$T720" \
  --out /tmp/same720 --json $R/same720_report.json
$OSD distill --adapter-rank 16 --init-adapter shipped --teacher-outputs served --n-prompts 1500 --teacher-cache "$T1500" \
  --out /tmp/more1500 --json $R/more1500_report.json
# all on the same 43 held-out prompts (both files end with them)
.venv/bin/python -m bench.heldout_agreement --teacher-cache "$T720" --heldout 43 --adapters shipped /tmp/same720 /tmp/more1500 | tee $R/heldout.txt
.venv/bin/python -m bench.step_time --teacher-cache "$T720" | tee $R/step_time.json
# the SQL and HumanEval shift streams from the adapter the package now carries (/tmp/more1500 copied to drafts/starting)
$OSD experiment shift --config bench/configs/shift_sql_200.yaml --draft-context 128 --steps-per-round 16 \
  --json $R/shift_sql_200_s16.json --png $R/shift_sql_200_s16.png
$OSD experiment shift --config bench/configs/shift_sql_200.yaml --draft-context 128 --steps-per-round 16 \
  --sources humaneval --domains code --order code --n 160 --json $R/shift_code_160_s16.json --png $R/shift_code_160_s16.png
