#!/bin/bash
# A/B: every process of the server but the engine replica at nice N vs all at 0; a fresh server
# (fresh state folder) each run
cd "$(dirname "$0")/../../.."
tmp=$(mktemp -d)
sed "s#state_dir: null#state_dir: $tmp/state#" serve_config.yaml > "$tmp/cfg.yaml"
N=${N:-10}
out=results/serving/priority; mkdir -p $out
for round in 1 2; do
 for v in plain nice; do
  pkill -INT -f "osd serve"; sleep 3; .venv/bin/ray stop --force >/dev/null 2>&1; sleep 2
  rm -rf "$tmp/state"
  (HF_HUB_OFFLINE=1 nohup .venv/bin/osd serve --config "$tmp/cfg.yaml" > "$tmp/serve_$v$round.log" 2>&1 &)
  for i in $(seq 1 90); do sleep 2; c=$(curl -s -o /dev/null -w "%{http_code}" 127.0.0.1:8000/ready); [ "$c" = 200 ] && break; done
  sleep 5
  eng=$(pgrep -f "ServeReplica:osd:DraftPool")
  if [ $v = nice ]; then
    for p in $(pgrep -f "ray::|ray/|osd serve|gcs_server|raylet"); do
      [ "$p" = "$eng" ] && continue
      for t in /proc/$p/task/*; do renice -n $N -p ${t##*/} >/dev/null 2>&1; done
    done
  fi
  echo "== round $round $v (engine $eng)"
  ps -eLo pid,ni,comm | awk '$2!=0' | wc -l
  HF_HUB_OFFLINE=1 .venv/bin/osd bench-serve --n 24 --distinct-levels --concurrency 1 8 --max-tokens 48 --json $out/${v}_$round.json 2>&1 | tr '\r' '\n' | grep -A3 "^ *conc "
 done
done
pkill -INT -f "osd serve"; sleep 3; .venv/bin/ray stop --force >/dev/null 2>&1
