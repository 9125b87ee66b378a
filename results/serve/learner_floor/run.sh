#!/bin/bash
# The learner's floor under traffic that never pauses: a fresh server per run (fresh learner state),
# 200 SQL requests of a source no draft was distilled on (DB-GPT's examples), 2 at a time, 32 tokens,
# learner.background.min_share 0 (shipped: nice 19, trains only in gaps), 0.1 and 0.25 (nice 0),
# two rounds in turn. Run from the repository root: bash results/serve/learner_floor/run.sh
set -u
out=results/serve/learner_floor; tmp=$(mktemp -d)
for v in 0 0.1 0.25; do
  bg="nice: 0, threads: 1, quiet_s: 5, min_share: $v"; [ "$v" = 0 ] && bg="nice: 19, threads: 1, quiet_s: 5"
  sed "s#state_dir: null#state_dir: $tmp/state_$v#; s#background: {nice: 19, threads: 1, quiet_s: 5}#background: {$bg}#" \
    serve_config.yaml > "$tmp/cfg_$v.yaml"
done
for round in 1 2; do
  for v in 0 0.25 0.1; do
    rm -rf "$tmp/state_$v"
    HF_HUB_OFFLINE=1 .venv/bin/osd serve --config "$tmp/cfg_$v.yaml" > "$tmp/serve.log" 2>&1 &
    for i in $(seq 1 120); do sleep 2; curl -sf http://127.0.0.1:8000/ready >/dev/null && break; done
    HF_HUB_OFFLINE=1 .venv/bin/osd bench-serve --curve 200 --curve-order file --window 40 --curve-concurrency 2 \
      --max-tokens 32 --curve-metrics --workload bench/data/open.jsonl,bench/data/router_train.jsonl \
      --sources dbgpt-example --json "$out/live_r${round}_share$v.json" 2>&1 | tr '\r' '\n' \
      | grep -v "learning curve" | tail -7 > "$out/live_r${round}_share$v.txt"
    curl -s http://127.0.0.1:8000/v1/stats > "$out/live_r${round}_share${v}_stats.json"
    pkill -INT -f "osd serve"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1
  done
done
rm -rf "$tmp"
