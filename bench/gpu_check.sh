#!/usr/bin/env bash
# GPU path check, GPU timings and the online experiments on a GPU (README, "GPU figures").
#   G=/path/SmolLM2-135M-Instruct.Q4_1.gguf OUT=results/gpu bash bench/gpu_check.sh STAGE...
# stages: lean (python -m bench.lean_check) | bench-lean (osd bench: lean target-only, HF eager float32,
# suffix tree and controller over the lean target) | profile | online:<domain> (osd experiment online, then osd bench of the learned draft on
# held-out prompts of that domain) | shift | speed (bench with the starting draft) | proposers (suffix
# tree, target-only and the controller on prompts none saw, per domain: results/suffix/run.sh speed) |
# turns (the same in 3-turn conversations: results/suffix/run.sh turns) | feature (the feature-conditioned
# draft learning online from the one-layer truncated target: results/suffix/run.sh feature) | turns-k
# (the suffix tree alone in those conversations at k_max KT, default 16; CT=1 adds the controller) | acceptance
# (the controller with the draft's acceptance set by hand: osd bench --draft-acceptance; NA prompts) | shift-sql
# (the shipped adapter learning online on SQL of a source it never saw, as on the CPU: NS records, default 200) |
# shift-speed (the same adapter static against learning under the controller with the suffix tree on, tokens/s).
# proposers, turns, turns-k and feature log to $OUT/<stage>.log (turns-k: turns_k.log) and print their
# tables; sizes NP (48 prompts), NT (20 conversations), NF (80 prompts). prepare: dequantise the GGUF once (cached), so that no timed stage
# pays it. On one H100: prepare ~20 s, proposers (NP=48) 3 min, turns (NT=20) 2.5 min, feature about
# 2 s a record and method. A machine without network: bench/offline_setup.sh first.
# The proposer stages serve their methods interleaved, request by request (--interleave): a plain step's
# time on the H100 moved by 15-25% between methods run one after another. IL= (empty) runs them so.
# SMOKE=1 runs the same commands with tiny sizes (DEVICE=cpu works too) to check the script.
# COMPILE=1: the lean target's layers compiled by torch.compile (ModelConfig.compile) in every stage; lean also
# times the uncompiled runner and bench-lean serves it beside (target_lean).
set -euo pipefail
G=${G:?path of the target .gguf}
OUT=${OUT:-results/gpu}
DEVICE=${DEVICE:-cuda}
CK=${CK:-/tmp/osd-gpu-ckpt}
mkdir -p "$OUT"
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
OSD="${PYTHON:-python3} -m osd.cli"
if [ "${SMOKE:-0}" = 1 ]; then R=2; N=6; NB=2; T=8; OFF=3; NP=4; NT=4; NF=4; TP=8; NS=${NS:-6}; NSS=${NSS:-4}
else R=25; N=${N:-150}; NB=${NB:-30}; T=32; OFF=${OFF:-45}; NP=${NP:-48}; NT=${NT:-20}; NF=${NF:-80}; TP=48; fi
CC=(); [ "${COMPILE:-0}" = 1 ] && CC=(--compile)
X="$OSD experiment online --draft-adapter none --adapter-rank 0 --lr 3e-4 --train-every 4 ${CC[*]} --target $G --device $DEVICE --workload bench/data/workload.jsonl --max-tokens $TP --window 10 --eval-every 2 --quantize ${QUANT:-auto}"
IL=${IL---interleave}
LEARN="--max-tokens $T --k 4 --train-every 4 --batch-records 16 --steps-per-round 8 --lr 1e-3 --gate-margin 0.02
       --adapter-rank 0 --window 20 --offline-seconds $OFF --offline-epochs 3 --offline-lr 1e-3 --head-vocab 8192 --threads 4"
for stage in "$@"; do
  echo "=== $stage $(date +%T)"
  case $stage in
    lean)  # the lean path's own check: graphs vs eager on a tiny model, the target's step (HF eager
           # float32, lean eager, lean graphs; v(j) for j = 1..9) and greedy equality under batching
      ${PYTHON:-python3} -m bench.lean_check --device "$DEVICE" --target "$G" --repeats $R "${CC[@]}" --json "$OUT/lean_check.json" ;;
    bench-lean)  # target-only on the lean runtime (served) against HF eager float32, the suffix tree and
                 # the controller over the lean target, interleaved, with each method's equality to target
      $OSD bench --target "$G" --device "$DEVICE" --quantize "${QUANT:-auto}" "${CC[@]}" --n $NB --max-tokens 64 \
        --methods target,${CC:+target_lean,}target_fp32,spec_suffix,spec_controller --json "$OUT/bench_lean.json" | tail -n 14 ;;
    profile)
      $OSD profile --target "$G" --device "$DEVICE" --repeats $R --max-verify 9 --json "$OUT/profile.json" ;;
    online:*)
      d=${stage#online:}
      $OSD experiment online --target "$G" --device "$DEVICE" --workload bench/data/train.jsonl --domains "$d" \
        --n $N $LEARN --checkpoint-dir "$CK/$d" --quiet --json "$OUT/online_$d.json" --png "$OUT/online_$d.png"
      draft="$CK/$d/draft/$(cat "$CK/$d/draft/LATEST")"
      for k in adaptive 4; do
        kk=(); [ $k = 4 ] && kk=(--fixed-k 4)
        $OSD bench --target "$G" --device "$DEVICE" --domains "$d" --n $NB --max-tokens 64 --draft-checkpoint "$draft" \
          "${kk[@]}" --methods target,spec --json "$OUT/bench_${d}_k$k.json" | tail -n 4
      done ;;
    shift)
      $OSD experiment shift --target "$G" --device "$DEVICE" --workload bench/data/train.jsonl --n $((N / 2 * 2)) \
        --order sql,math,code,chat $LEARN --window 10 --quiet --json "$OUT/shift.json" --png "$OUT/shift.png" ;;
    shift-sql)  # the CPU's shift figure on this device: the shipped adapter learning online at the server's
                # settings on SQL of a source it was never distilled on (bench/configs/shift_sql_200.yaml; NS records;
                # SR: steps a round, default the server's 16)
      $OSD experiment shift --config bench/configs/shift_sql_200.yaml --target "$G" --device "$DEVICE" \
        --quantize "${QUANT:-auto}" --n ${NS:-200} --draft-context 128 --steps-per-round ${SR:-16} --quiet --json "$OUT/shift_sql.json" --png "$OUT/shift_sql.png" | tail -n 4 ;;
    shift-speed)  # the 1.1x asked of learning, on this device: the controller over the suffix tree, prompt lookup
                  # and the shipped adapter, the adapter static against learning, interleaved request by request,
                  # on SQL then code of sources it was never distilled on (bench/configs/shift_controller.yaml; NSS
                  # records, default 120; KS: k_max, default the config's 6); tokens/s per window in shift_speed.log
      $OSD experiment shift --config bench/configs/shift_controller.yaml --target "$G" --device "$DEVICE" \
        --quantize "${QUANT:-auto}" "${CC[@]}" --draft-context 128 --steps-per-round ${SR:-16} --n ${NSS:-120} ${KS:+--k $KS} \
        --json "$OUT/shift_speed.json" >"$OUT/shift_speed.log" 2>&1
      tail -n 12 "$OUT/shift_speed.log" ;;
    speed)
      $OSD bench --target "$G" --device "$DEVICE" --n $NB --max-tokens 64 --methods target,spec,spec_lookup,hf_assisted,hf_lookup \
        --json "$OUT/bench_untrained.json" | tail -n 8 ;;
    prepare)
      ${PYTHON:-python3} -c "from speculative.models import resolve_model_folder; print(resolve_model_folder('$G')[0])" ;;
    proposers)
      $X --n $NP --k 6 --adaptive --methods suffix,target,controller $IL --json "$OUT/proposers.json" >"$OUT/proposers.log" 2>&1
      tail -n 6 "$OUT/proposers.log" ;;
    turns)
      $X --n $NT --turns 3 --k 6 --adaptive --methods suffix,target,controller $IL --json "$OUT/turns.json" >"$OUT/turns.log" 2>&1
      tail -n 6 "$OUT/turns.log" ;;
    turns-k)  # the suffix tree (CT=1: and the controller) in the same conversations at a larger k_max (KT, 16):
              # on a GPU verifying 7-17 tokens costs about what 2-5 do, so long matches pay where on a CPU they do not
      $X --n $NT --turns 3 --k ${KT:-16} --adaptive --methods suffix,target${CT:+,controller} $IL --json "$OUT/turns_k${KT:-16}.json" >"$OUT/turns_k.log" 2>&1
      tail -n 5 "$OUT/turns_k.log" ;;
    acceptance)  # what a better-learned draft would buy on this device: the controller with the shipped draft's
                 # acceptance set by hand (its forwards still run), SQL and code of sources never distilled on, 32 tokens
                 # (docs/proposers.md, "What a better draft would buy here"; NA prompts, default 60)
      $OSD bench --target "$G" --device "$DEVICE" --quantize "${QUANT:-auto}" --workload bench/data/open.jsonl --domains sql code \
        --n ${NA:-60} --max-tokens 32 --methods target,spec_controller --draft-adapter shipped --draft-context 128 \
        --draft-acceptance 0.2 0.6 0.8 1.0 --json "$OUT/draft_acceptance.json" | tail -n 16 ;;
    feature)
      $X --n $NF --k 4 --methods static,online --draft-kind feature --json "$OUT/feature.json" >"$OUT/feature.log" 2>&1
      tail -n 5 "$OUT/feature.log" ;;
    *) echo "unknown stage $stage"; exit 2 ;;
  esac
done
