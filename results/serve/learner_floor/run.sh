#!/bin/bash
# The learner's floor under traffic that never pauses: a fresh server per run (fresh learner state),
# 200 SQL requests of a source no draft was distilled on (DB-GPT's examples), 2 at a time, 32 tokens,
# learner.background.min_share 0 (shipped: nice 19, trains only in gaps), 0.1 and 0.25 (nice 0),
# two rounds in turn. Run from the repository root: bash results/serve/learner_floor/run.sh
# STEPS: the learner's steps a round (default 2, as recorded; the server's are now up to 16, ended
# after 2 once the next round is due: STEPS=16 TAG=_s16 SHARES=0.25 ROUNDS=1 for that run).
set -u
out=results/serve/learner_floor; tmp=$(mktemp -d)
STEPS=${STEPS:-2}; TAG=${TAG:-}; SHARES=${SHARES:-"0 0.25 0.1"}; ROUNDS=${ROUNDS:-"1 2"}
for v in $SHARES; do
  bg="nice: 0, threads: 1, quiet_s: 5, min_share: $v"; [ "$v" = 0 ] && bg="nice: 19, threads: 1, quiet_s: 5"
  sed "s#state_dir: null#state_dir: $tmp/state_$v#; s#background: {nice: 19, threads: 1, quiet_s: 5, min_share: 0}#background: {$bg}#;
       s#steps_per_round: 16, min_steps_per_round: 2,#steps_per_round: $STEPS, min_steps_per_round: 2,#" \
    serve_config.yaml > "$tmp/cfg_$v.yaml"
  grep -q "steps_per_round: $STEPS," "$tmp/cfg_$v.yaml" && grep -q "background: {$bg}" "$tmp/cfg_$v.yaml" \
    || { echo "serve_config.yaml changed: the settings were not applied" >&2; exit 1; }
done
for round in $ROUNDS; do
  for v in $SHARES; do
    rm -rf "$tmp/state_$v"
    HF_HUB_OFFLINE=1 .venv/bin/osd serve --config "$tmp/cfg_$v.yaml" > "$tmp/serve.log" 2>&1 &
    for i in $(seq 1 120); do sleep 2; curl -sf http://127.0.0.1:8000/ready >/dev/null && break; done
    HF_HUB_OFFLINE=1 .venv/bin/osd bench-serve --curve 200 --curve-order file --window 40 --curve-concurrency 2 \
      --max-tokens 32 --curve-metrics --workload bench/data/open.jsonl,bench/data/router_train.jsonl \
      --sources dbgpt-example --json "$out/live_r${round}_share$v$TAG.json" 2>&1 | tr '\r' '\n' \
      | grep -v "learning curve" | tail -7 > "$out/live_r${round}_share$v$TAG.txt"
    curl -s http://127.0.0.1:8000/v1/stats > "$out/live_r${round}_share$v${TAG}_stats.json"
    pkill -INT -f "osd serve"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1
  done
done
rm -rf "$tmp"
