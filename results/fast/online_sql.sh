set -e
cd /work/main
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
rm -rf /tmp/osd-ck/sql
date
.venv/bin/osd experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 --workload bench/data/train.jsonl --domains sql --n 120 --max-tokens 32 --k 4 \
  --methods static,online --train-every 4 --batch-records 16 --steps-per-round 8 --lr 1e-3 --gate-margin 0.02 --window 20 \
  --head-vocab 8192 --checkpoint-dir /tmp/osd-ck/sql --quiet --json results/fast/online_sql_int4.json
date
d=/tmp/osd-ck/sql/draft/$(cat /tmp/osd-ck/sql/draft/LATEST)
.venv/bin/osd bench --workload bench/data/workload.jsonl --exclude bench/data/train.jsonl --domains sql --n 40 --max-tokens 48 \
  --draft-checkpoint $d --methods target,spec,spec_lookup,llamacpp --json results/fast/bench_sql_learned.json
date
