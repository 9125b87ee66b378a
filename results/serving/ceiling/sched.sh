#!/bin/bash
# run time and runqueue wait of the engine replica's threads over one level, against a running
# `osd serve` (C: concurrency, default 8; W: workload)
cd "$(dirname "$0")/../../.."
tmp=$(mktemp -d)
eng=$(pgrep -f "ServeReplica:osd:DraftPool")
ss() { for t in /proc/$eng/task/*; do echo "${t##*/} $(cat $t/schedstat)"; done; }
ss > $tmp/s0
HF_HUB_OFFLINE=1 .venv/bin/osd bench-serve --workload ${W:-bench/data/mixture.jsonl} --n 24 --concurrency ${C:-8} --max-tokens 48 --json $tmp/s.json 2>&1 | tr '\r' '\n' | grep -A1 "^ *conc "
ss > $tmp/s1
TMP=$tmp python3 - <<'PY'
import json, os
tmp = os.environ['TMP']
a={l.split()[0]:list(map(int,l.split()[1:])) for l in open(f'{tmp}/s0')}
b={l.split()[0]:list(map(int,l.split()[1:])) for l in open(f'{tmp}/s1')}
w=json.load(open(f'{tmp}/s.json'))['levels'][0]['wall_s']
print(f"level wall {w:.2f} s")
for t in b:
    if t not in a: continue
    run=(b[t][0]-a[t][0])/1e9; wait=(b[t][1]-a[t][1])/1e9; n=b[t][2]-a[t][2]
    if run>0.1: print(f"tid {t}: ran {run:.2f} s, waited runnable {wait:.2f} s, {n} slices")
PY
