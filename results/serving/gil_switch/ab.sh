#!/bin/bash
cd /work/main
# the switch interval was read from OSD_SWITCH by a temporary line in the replica; it is now loop.gil_switch_s
# CFG: serve_config.yaml with a state_dir of its own (columns: interval, concurrency, tok/s, TTFT p50 ms, steps, target ms/step, verify wait ms/step)
i=0
for sw in 0.005 0.0005 0.005 0.0005; do
  i=$((i+1))
  pkill -INT -f "osd serve"; sleep 4; .venv/bin/ray stop --force >/dev/null 2>&1; rm -rf /tmp/osdA
  OSD_SWITCH=$sw HF_HUB_OFFLINE=1 nohup .venv/bin/osd serve --config $CFG > /tmp/serve_sw.log 2>&1 &
  for t in $(seq 1 60); do curl -sf 127.0.0.1:8000/ready >/dev/null && break; sleep 5; done
  sleep 30
  curl -s -X POST 127.0.0.1:8000/admin/learner/pause > /dev/null
  HF_HUB_OFFLINE=1 timeout 600 .venv/bin/osd bench-serve --n 24 --workload bench/data/mixture.jsonl --concurrency 1 8 --distinct-levels --max-tokens 48 --json results/serving/gil_switch/sw_${i}_${sw}.json > /dev/null 2>&1
  python3 -c "
import json; d=json.load(open('results/serving/gil_switch/sw_${i}_${sw}.json'))
for l in d['levels']: print('$sw', l['concurrency'], round(l['tokens_per_s'],1), l['ttft_ms']['p50'], l['steps'], round(l['target_ms_per_step'],1), round(l['verify_wait_ms_per_step'],1))
" >> results/serving/gil_switch/ab.txt
done
pkill -INT -f "osd serve"; sleep 4; .venv/bin/ray stop --force >/dev/null 2>&1
echo done >> results/serving/gil_switch/ab.txt
