#!/usr/bin/env bash
# The measurements of docs/proposers.md (this machine: 2 cores, int4 target), run alone.
# Every stream is of prompts no proposer saw: the token drafts start untrained (never distilled),
# every suffix tree starts empty, and the feature draft starts as the one-layer truncated target.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
X=".venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload bench/data/workload.jsonl"
case "${1:-all}" in
  alpha|all)  # A. 120 prompts of four domains (30 each), adaptive k (k_max 6): alpha of every proposer
    $X --n 120 --max-tokens 48 --k 6 --adaptive --methods target,static,online,suffix,controller --window 10 \
       --eval-every 2 --json results/suffix/online.json --png results/suffix/online.png ;;&
  turns|all)  # B. conversations: 40 prompts (10 a domain), 3 turns each (history re-sent with a follow-up)
    $X --n 40 --turns 3 --max-tokens 48 --k 6 --adaptive --methods target,lookup,suffix,controller --window 10 \
       --eval-every 2 --json results/suffix/turns.json --png results/suffix/turns.png ;;&
  speed|all)  # C. A's stream again, alone on the machine: tokens/s and speedups over target-only
    $X --n 120 --max-tokens 48 --k 6 --adaptive --methods target,lookup,suffix,controller --window 10 \
       --eval-every 2 --json results/suffix/speed.json ;;&
  feature|all)  # D. the feature-conditioned draft vs the token draft, online, fixed k = 4 (the paper's alpha)
    $X --n 80 --max-tokens 48 --k 4 --methods static,online --draft-kind feature --window 10 --eval-every 2 \
       --json results/suffix/feature.json --png results/suffix/feature.png
    $X --n 80 --max-tokens 48 --k 4 --methods static,online --draft-kind truncated --window 10 --eval-every 2 \
       --json results/suffix/token.json --png results/suffix/token.png ;;&
  feature-sql|all)  # E. the feature draft learning online on one domain: the 60 SQL prompts
    $X --domains sql --n 60 --max-tokens 48 --k 4 --methods online --draft-kind feature --window 10 --eval-every 2 \
       --json results/suffix/feature_sql.json ;;&
  replicas|all)  # F. suffix trees on 2 and 4 draft replicas (each request to one drawn at random, seeded),
    # sharing outputs or not: A's 120 single-turn prompts, then B's conversations
    $X --n 120 --max-tokens 48 --k 6 --methods suffix,suffix-split@2,suffix@2,suffix-split@4 --window 10 \
       --eval-every 2 --json results/suffix/replicas.json
    $X --n 40 --turns 3 --max-tokens 48 --k 6 --methods suffix-split@2,suffix@2 --window 10 \
       --eval-every 2 --json results/suffix/replicas_turns.json ;;
esac
