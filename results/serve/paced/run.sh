#!/bin/bash
# Learning in the gaps of traffic that arrives as a service's does: a fresh server per arm (fresh
# learner state), 100 SQL requests of a source no draft was distilled on (DB-GPT's examples), sent
# at the times of a Poisson process of RATE a second (seeded; at most 4 in flight), 32 tokens; the
# shipped config (the learner trains once 5 s pass without traffic) against the same with
# learner.enabled: false. Run from the repository root: bash results/serve/paced/run.sh
set -u
out=results/serve/paced; tmp=$(mktemp -d)
RATE=${RATE:-0.2}; N=${N:-100}; ARMS=${ARMS:-"on off"}; TAG=${TAG:-}
sed "s#state_dir: null#state_dir: $tmp/state#" serve_config.yaml > "$tmp/cfg_on.yaml"
sed "s#state_dir: null#state_dir: $tmp/state#; s#        enabled: true#        enabled: false#" serve_config.yaml > "$tmp/cfg_off.yaml"
grep -q "state_dir: $tmp/state" "$tmp/cfg_on.yaml" && grep -q "        enabled: false" "$tmp/cfg_off.yaml" \
  || { echo "serve_config.yaml changed: the settings were not applied" >&2; exit 1; }
for arm in $ARMS; do
  rm -rf "$tmp/state"
  HF_HUB_OFFLINE=1 .venv/bin/osd serve --config "$tmp/cfg_$arm.yaml" > "$tmp/serve_$arm.log" 2>&1 &
  for i in $(seq 1 120); do sleep 2; curl -sf http://127.0.0.1:8000/ready >/dev/null && break; done
  HF_HUB_OFFLINE=1 .venv/bin/osd bench-serve --curve "$N" --curve-order file --window 20 --curve-concurrency 4 \
    --curve-rate "$RATE" --max-tokens 32 --curve-metrics --workload bench/data/open.jsonl,bench/data/router_train.jsonl \
    --sources dbgpt-example --json "$out/paced_${arm}$TAG.json" 2>&1 | tr '\r' '\n' \
    | grep -v "learning curve" | tail -8 > "$out/paced_${arm}$TAG.txt"
  curl -s http://127.0.0.1:8000/v1/stats > "$out/paced_${arm}${TAG}_stats.json"
  pkill -INT -f "osd serve"; sleep 5; .venv/bin/ray stop --force > /dev/null 2>&1
done
rm -rf "$tmp"
