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
  mixture|all)  # the mixture stream (112 records, none in train.jsonl) served by the same routings, every draft
    # starting from the general draft (and the single-draft baseline) against each named domain's draft starting
    # from its own; side by side, one thread each
    X=".venv/bin/osd experiment mixture --workload bench/data/mixture.jsonl --train bench/data/router_train.jsonl
      --n-per-label 16 --max-tokens 32 --k 4 --train-every 4 --batch-records 16 --steps-per-round 8 --lr 3e-4
      --window 8 --draft-checkpoint default --threads 1 --spawn-min-records 8 --spawn-window 60 --spawn-alpha 0.5
      --spawn-min-tokens 48 --no-resample"
    $X --methods both,supervised,clusters --json $R/mixture_general.json > $R/mixture_general.txt 2> $R/mixture_general.log &
    $X --methods both,supervised,single --json $R/mixture_domains.json \
      --domain-checkpoints "code=$C/drafts/domain-code,sql=$C/drafts/domain-sql,math=$C/drafts/domain-math,chat=$C/drafts/domain-chat" \
      > $R/mixture_domains.txt 2> $R/mixture_domains.log &
    wait
    ;;&
esac
