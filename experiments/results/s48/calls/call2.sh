#!/usr/bin/env bash
# session 48 call 2 (after call 1 passes): the decode loop at 1 row (head / float32 logits), the
# chi-square GPU tests of "cdf", and ncu of the "cdf" kernel at 64 rows on float32 and bfloat16
# logits (speed of light, warp stalls, memory: what limits it now)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 110 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp-cdf reset-cdf-state --logits-dtypes head float32 \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 120 python3 -m pytest -q tests/test_sampling_gpu.py -k "chi_square and cdf" \
  -p no:cacheprovider > $out/x/chi_square.log 2>&1
echo "chi-square rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/x/chi_square.log | tee -a $log
for dt in float32 bfloat16; do
  t0=$(date +%s)
  timeout 60 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
    --section LaunchStats --section Occupancy --csv \
    python3 experiments/bench_sampler.py --batch 64 --logits lm --methods kernel --variants cdf \
    --samplers reset_top_p --steps 2 --repeats 1 --stats two_pass --logits-dtype $dt \
    --out $out/x/ncu_sampler_$dt.json > $out/x/cdf64_$dt.csv 2> $out/x/ncu_$dt.err
  echo "ncu $dt rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
