#!/usr/bin/env bash
# The suffix-tree / controller measurements of docs/suffix.md (this machine: 2 cores, int4 target).
# Every stream is of prompts no proposer saw: the token draft is the untrained truncated target
# (never distilled) and every suffix tree starts empty.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
# A. one pass over 120 prompts of four domains (30 each), adaptive k (k_max 6): speed and alpha
.venv/bin/osd experiment online --workload bench/data/workload.jsonl --n 120 --max-tokens 48 --k 6 --adaptive \
  --methods target,static,online,suffix,controller --window 10 --eval-every 2 \
  --json results/suffix/online.json --png results/suffix/online.png
# B. conversations: 40 prompts (10 a domain), 3 turns each (history re-sent with a follow-up)
.venv/bin/osd experiment online --workload bench/data/workload.jsonl --n 40 --turns 3 --max-tokens 48 --k 6 --adaptive \
  --methods target,lookup,suffix,controller --window 10 --eval-every 2 \
  --json results/suffix/turns.json --png results/suffix/turns.png
