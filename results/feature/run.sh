#!/usr/bin/env bash
# The measurements of docs/proposers.md's "Starting distilled" (this machine: 2 cores, int4 target),
# run alone. Both drafts are distilled on the same 200 prompts of bench/data/train.jsonl for 420 s
# (never on bench/data/workload.jsonl, whose prompts the streams below use), then learn online.
set -euo pipefail
cd "$(dirname "$0")/../.."
export HF_HUB_OFFLINE=1
X=".venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload bench/data/workload.jsonl --n 80 --max-tokens 48 --k 4 --methods static,online --window 10 --eval-every 2"
case "${1:-all}" in
  distill|all)  # the two starting drafts (cached under ~/.cache/osd-serve/drafts/default and default-feature);
    # the token draft measured in docs/proposers.md was this command's, run earlier: its saved meta
    # is token_default_meta.json (held-out agreement 0.439 after 283 steps)
    .venv/bin/osd distill --n-prompts 200 --seconds 420 --json results/feature/distill_token.json
    .venv/bin/osd distill --kind feature --n-prompts 200 --seconds 420 --json results/feature/distill_feature.json ;;&
  more|all)  # the feature draft on twice the prompts, its input embeddings frozen (EAGLE's practice), then online
    .venv/bin/osd distill --kind feature --n-prompts 400 --seconds 600 --freeze-embeddings \
      --out "${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}/drafts/feature-400-frozen" --json results/feature/distill_feature_400_frozen.json
    $X --draft-kind feature --draft-checkpoint "${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}/drafts/feature-400-frozen" \
      --json results/feature/feature_400_frozen.json ;;&
  positions|all)  # equal data: one teacher file (the same 400 prompts, with the target's features) for three
    # drafts, 600 s each; --prompt-positions also trains on the prompts' positions; then each static
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"; T="$C/data/teacher-train-400-features.pt"
    D=".venv/bin/osd distill --n-prompts 400 --seconds 600 --teacher-cache $T"
    $D --prompt-positions --out "$C/drafts/token-400-prompts" --json results/feature/distill_token_400_prompts.json
    $D --out "$C/drafts/token-400" --json results/feature/distill_token_400.json
    $D --kind feature --freeze-embeddings --prompt-positions --out "$C/drafts/feature-400-prompts" \
      --json results/feature/distill_feature_400_prompts.json
    for d in token-400:truncated token-400-prompts:truncated feature-400-prompts:feature; do
      $X --methods static --draft-kind "${d#*:}" --draft-checkpoint "$C/drafts/${d%%:*}" --json "results/feature/${d%%:*}.json"
    done ;;&
  online-prompts|all)  # the feature draft distilled with prompts, learning online without and with the
    # records' prompt positions (the target's head over their features)
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"
    $X --methods online --draft-kind feature --draft-checkpoint "$C/drafts/feature-400-prompts" \
      --json results/feature/feature-400-prompts-online.json
    $X --methods online --draft-kind feature --draft-checkpoint "$C/drafts/feature-400-prompts" --prompt-positions \
      --json results/feature/feature-400-prompts-online-prompts.json ;;&
  long)  # a longer stream: all 240 prompts of the workload (60 a domain, never trained on), both drafts
    # distilled on the same 200 prompts (prompt positions on, the default), static and learning online;
    # the two streams run side by side, one thread each (alpha only: their tokens/s are not used)
    .venv/bin/osd distill --kind feature --n-prompts 200 --seconds 420 --threads 2 --json results/feature/distill_feature_240run.json
    L=".venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload bench/data/workload.jsonl --n 240 --max-tokens 48 --k 4 --methods static,online --window 20 --eval-every 4 --threads 1 --draft-checkpoint default"
    $L --draft-kind feature --json results/feature/long_feature.json --png results/feature/long_feature.png &
    $L --draft-kind truncated --json results/feature/long_token.json --png results/feature/long_token.png
    wait ;;
  fused|all)  # EAGLE-3's fusion at equal data: one teacher file (200 prompts of train.jsonl, the target's
    # layers 2 and 15 and its final feature) for three drafts, 420 s each: fusing the three, the final
    # feature alone (its last 576 columns), the 2-layer token draft; then each static on D's 80 unseen prompts
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"; T="$C/data/teacher-200-fused-2-15.pt"
    D=".venv/bin/osd distill --n-prompts 200 --seconds 420 --teacher-cache $T"
    $D --kind feature --feature-layers 2,15 --out "$C/drafts/feature-fused-200" --json results/feature/distill_fused_200.json
    $D --kind feature --out "$C/drafts/feature-final-200" --json results/feature/distill_final_200.json
    $D --out "$C/drafts/token-200" --json results/feature/distill_token_200.json
    for d in feature-fused-200:feature feature-final-200:feature token-200:truncated; do
      $X --methods static --draft-kind "${d#*:}" --draft-checkpoint "$C/drafts/${d%%:*}" --json "results/feature/${d%%:*}.json"
    done ;;&
  feature-loss|all)  # EAGLE's feature loss at equal data: one teacher file (200 prompts, final features), two
    # feature drafts distilled on it for 7 epochs each (one thread each, side by side), without and with the
    # loss at weight 1; then each static on D's 80 unseen prompts
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"; T="$C/data/teacher-200-features.pt"
    # the teacher file first (a one-step run collects and caches it), so the two runs below do not both collect it
    [ -f "$T" ] || .venv/bin/osd distill --kind feature --n-prompts 200 --seconds 1 --epochs 1 --teacher-cache $T --out "$C/drafts/throwaway"
    for w in 0 1; do
      .venv/bin/osd distill --kind feature --n-prompts 200 --seconds 3000 --epochs 7 --threads 1 --feature-loss $w \
        --teacher-cache $T --out "$C/drafts/feature-200-reg$w" --json "results/feature/distill_reg$w.json" &
    done; wait
    for w in 0 1; do
      $X --methods static --threads 1 --draft-kind feature --draft-checkpoint "$C/drafts/feature-200-reg$w" \
        --json "results/feature/feature-200-reg$w.json" &
    done; wait ;;&
  stream500|all)  # 500 unseen prompts of the four domains (the workload's 240 first, then the other files'
    # records of those domains, round-robin; the starting draft's training prompts dropped): the feature draft of
    # feature-loss (weight 0), static and learning online side by side, one thread each
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"
    W="bench/data/workload.jsonl bench/data/mixture.jsonl bench/data/open.jsonl bench/data/router_train.jsonl"
    for m in static online; do
      .venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload $W --domains code sql math chat --n 500 --max-tokens 48 --k 4 \
        --methods $m --window 20 --eval-every 4 --threads 1 --draft-kind feature --draft-checkpoint "$C/drafts/feature-200-reg0" \
        --json "results/feature/stream500_feature_$m.json" &
    done; wait ;;&
  stream500-token|all)  # the same 500-record stream for the token draft at equal data: osd distill's general
    # draft on the same 200 prompts for 7 epochs (results/route/domains/run.sh distill), static and online
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"
    W="bench/data/workload.jsonl bench/data/mixture.jsonl bench/data/open.jsonl bench/data/router_train.jsonl"
    for m in static online; do
      .venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload $W --domains code sql math chat --n 500 --max-tokens 48 --k 4 \
        --methods $m --window 20 --eval-every 4 --threads 1 --draft-checkpoint default \
        --json "results/feature/stream500_token_$m.json" &
    done; wait ;;&
  scale|all)  # more data at equal data: one teacher file of every train.jsonl prompt not in the workload
    # (665 prompts and 40 held out, with the final features), a feature draft and the 2-layer token draft distilled
    # on it for 4 epochs each (side by side, one thread each), then each static on D's 80 unseen prompts
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"; T="$C/data/teacher-800-features.pt"
    D=".venv/bin/osd distill --n-prompts 800 --seconds 5000 --epochs 4 --threads 1 --teacher-cache $T"
    [ -f "$T" ] || .venv/bin/osd distill --kind feature --n-prompts 800 --seconds 1 --epochs 1 --teacher-cache $T --out "$C/drafts/throwaway"
    $D --kind feature --out "$C/drafts/feature-665" --json results/feature/distill_feature_665.json &
    $D --out "$C/drafts/token-665" --json results/feature/distill_token_665.json &
    wait
    for d in feature-665:feature token-665:truncated; do
      $X --methods static --threads 1 --draft-kind "${d#*:}" --draft-checkpoint "$C/drafts/${d%%:*}" --json "results/feature/${d%%:*}.json" &
    done; wait ;;&
  scale-online|all)  # the 670-prompt feature draft learning online over D's 80 prompts, without and with the feature loss
    C="${OSD_CACHE_DIR:-$HOME/.cache/osd-serve}"
    $X --methods online --threads 1 --draft-kind feature --draft-checkpoint "$C/drafts/feature-665" \
      --json results/feature/feature-665-online.json &
    $X --methods online --threads 1 --draft-kind feature --draft-checkpoint "$C/drafts/feature-665" --feature-loss 1 \
      --json results/feature/feature-665-online-floss.json &
    wait ;;&
  online|all)  # each starting draft on 80 unseen prompts (20 a domain), fixed k = 4, static and learning online
    $X --draft-kind feature --draft-checkpoint default --json results/feature/feature_distilled.json --png results/feature/feature_distilled.png
    $X --draft-kind truncated --draft-checkpoint default --json results/feature/token_distilled.json --png results/feature/token_distilled.png ;;
esac
