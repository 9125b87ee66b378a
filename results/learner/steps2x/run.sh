#!/usr/bin/env bash
# The package's starting adapter trained for as long again, and what it was compared with
# (docs/proposers.md, "Twice the steps"). One run each on a 2-core CPU; about 95 minutes in all.
set -euo pipefail
cd "$(dirname "$0")/../../.."
OSD=.venv/bin/osd
T=${T:-/tmp/teacher720.pt}   # the teacher's outputs and distributions, collected once, read back after
# the first adapter (drafts/starting at commit 7728adf) as the start; --out defaults to drafts/starting
$OSD distill --adapter-rank 16 --init-adapter shipped --teacher-outputs served --teacher-cache "$T" \
  --out /tmp/continued --json results/learner/steps2x/continued_report.json
# the same budget from zero adapters with a cosine rate instead (not shipped)
$OSD distill --adapter-rank 16 --teacher-outputs served --lr-schedule cosine --teacher-cache "$T" \
  --out /tmp/cosine --json results/learner/steps2x/cosine_report.json
# all three on the same held-out prompts (the teacher file's last 43); run before /tmp/continued replaced the package's
.venv/bin/python -m bench.heldout_agreement --teacher-cache "$T" --heldout 43 --adapters shipped /tmp/cosine /tmp/continued none
for f in workload open; do
  $OSD bench --max-tokens 48 --fixed-k 4 --methods spec --draft truncated --n 240 --draft-adapter /tmp/continued \
    --workload bench/data/$f.jsonl --threads 1 --json results/learner/steps2x/continued_${f}240.json
done
