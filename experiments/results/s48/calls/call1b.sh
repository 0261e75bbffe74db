#!/usr/bin/env bash
# session 48 call 1b (call 1 cut to the device time left): the GPU tests of "cdf", "auto" and
# bfloat16 logits, then kernel alone on bfloat16 / float32 logits at 64 rows
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1b.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 110 python3 -m pytest -q tests/test_sampling_gpu.py -x \
  -k "(cdf and not chi_square) or default_auto or bfloat16" -p no:cacheprovider > $out/x/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|Error|assert" $out/x/gpu_tests.log | tail -8 | tee -a $log
for dt in bfloat16 float32; do
  timeout 35 python3 experiments/bench_sampler.py --batch 64 --logits lm --methods kernel \
    --variants cdf --samplers temperature_top_p reset_top_p --stats two_pass \
    --logits-dtype $dt --out $out/x/kernel_alone_$dt.json > $out/x/kernel_alone_$dt.log 2>&1
  echo "kernel alone $dt rc=$?" | tee -a $log
  grep -o '"greedy_us": [0-9.]*\|[a-z_]*/kernel:[a-z]*_\(over_greedy_\)\?us": [0-9.]*' $out/x/kernel_alone_$dt.log | tee -a $log
done
