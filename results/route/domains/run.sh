#!/usr/bin/env bash
# The mixture of drafts with drafts that differ: a starting draft per named domain, distilled offline
# on that domain's prompts of train.jsonl (none of the mixture stream's), against every draft starting
# from the general one. One teacher file (every train.jsonl prompt not in the workload, collected once
# by results/feature/run.sh's `scale` case) serves every draft: equal teacher data, 420 s each, one thread.
set -euo pipefail
cd "$(dirname "$0")/../../.."
C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"; T="$C/data/teacher-800-features.pt"; R=results/route/domains
[ -f "$T" ] || .venv/bin/osd distill --kind feature --n-prompts 800 --seconds 1 --epochs 1 --teacher-cache $T --out "$C/drafts/throwaway"
D=".venv/bin/osd distill --seconds 420 --threads 1 --teacher-cache $T"
case "${1:-all}" in
  distill|all)
    $D --n-prompts 200 --json $R/distill_general.json &  # the general starting draft ("default")
    $D --domain code --out "$C/drafts/domain-code" --json $R/distill_code.json &
    wait
    $D --domain sql --out "$C/drafts/domain-sql" --json $R/distill_sql.json &
    $D --domain math --out "$C/drafts/domain-math" --json $R/distill_math.json &
    wait
    $D --domain chat --out "$C/drafts/domain-chat" --json $R/distill_chat.json
    ;;&
esac
