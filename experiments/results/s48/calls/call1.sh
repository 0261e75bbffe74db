#!/usr/bin/env bash
# session 48 call 1: the GPU tests of "cdf" (weights relative to the row max), of "auto" (now
# "cdf" for top-p alone) and of bfloat16 logits; the 36-layer decode loop at 64 rows carrying
# the head's bfloat16 logits against float32 ones; kernel alone grid / cdf on float32 and
# bfloat16 logits at 64 rows
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 110 python3 -m pytest -q tests/test_sampling_gpu.py -x \
  -k "(cdf and not chi_square) or default_auto or bfloat16" -p no:cacheprovider > $out/x/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|Error|assert" $out/x/gpu_tests.log | tail -8 | tee -a $log
t0=$(date +%s)
timeout 125 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset-cdf-state --logits-dtypes head float32 \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
for dt in float32 bfloat16; do
  t0=$(date +%s)
  timeout 40 python3 experiments/bench_sampler.py --batch 64 --logits lm flat --methods kernel \
    --variants grid cdf --samplers temperature_top_p reset_top_p --stats two_pass \
    --logits-dtype $dt --out $out/x/kernel_alone_$dt.json > $out/x/kernel_alone_$dt.log 2>&1
  echo "kernel alone $dt rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -o '"logits": "[a-z]*", "batch": [0-9]*\|"greedy_us": [0-9.]*\|[a-z_]*/kernel:[a-z]*_over_greedy_us": [0-9.]*' $out/x/kernel_alone_$dt.log | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
