#!/usr/bin/env bash
# session 50 call 4 (the last minutes): on an H200 the decode loop at 1 and 64 rows under the
# default ("cdf", head logits; greedy / Temperature / ReSET / top-k 20); on an H100 the batch-1
# loop with greedy, ReSET on "grid-state" and on "cdf-state" alternated (which is faster at 1 row);
# then on either card ncu's per-SASS counters with warp-stall samples of the "cdf" kernel at 1 row
# (Temperature and ReSET + top-p, bfloat16 logits): which segments hold the 27 us (the sweeps'
# loads, the grid barriers' polls, the combine and the draws)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call4.log
mkdir -p $out/x
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log)
run() {  # name batch gen-len samplers...
  local name=$1 b=$2 n=$3 t0=$(date +%s)
  shift 3
  timeout 150 python3 experiments/bench_decode.py --modes nvfp4 --batch $b --gen-len $n --repeats 5 \
    --no-breakdown --samplers "$@" --logits-dtypes head --out $out/x/$name.json > $out/x/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -E "ms/token|rror" $out/x/$name.log | tee -a $log
}
if [[ $gpu == *H200* ]]; then
  run decode_b1 1 256 greedy temp-cdf reset-cdf-state topk20 greedy
  run decode_b64 64 128 greedy temp-cdf reset-cdf-state topk20 greedy
else
  run decode_b1_reset_abab 1 256 greedy reset-grid-state reset-cdf-state greedy reset-grid-state \
    reset-cdf-state greedy
fi
for s in temperature_top_p reset_top_p; do
  t0=$(date +%s)
  timeout 90 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section InstructionStats --section WarpStateStats --page source \
    --csv --print-source sass python3 experiments/bench_sampler.py --batch 1 --logits lm \
    --methods kernel --variants cdf --samplers $s --steps 2 --repeats 1 --stats two_pass \
    --logits-dtype bfloat16 --out $out/x/ncu_$s.json > $out/x/cdf1_sass_$s.csv 2> $out/x/ncu_$s.err
  echo "ncu $s rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  python3 experiments/ncu_sass_segments.py $out/x/cdf1_sass_$s.csv 2>&1 | head -40 | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
