#!/usr/bin/env bash
# session 47 call 3 (weights relative to the row max: one barrier more, an all-integer CDF, the
# same token for any plan; "auto" takes "cdf" for top-p alone from 2 rows): the GPU tests of
# "cdf" and of "auto", kernel alone grid vs cdf at 1 / 8 / 64 rows, the 36-layer decode loop at
# 64 and 1 rows
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 110 python3 -m pytest -q tests/test_sampling_gpu.py \
  -k "(cdf and not chi_square) or default_auto" -p no:cacheprovider > $out/x/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -4 $out/x/gpu_tests.log | tee -a $log
t0=$(date +%s)
timeout 45 python3 experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel \
  --variants grid cdf --samplers temperature_top_p reset_top_p --stats two_pass \
  --out $out/x/kernel_alone.json > $out/x/kernel_alone.log 2>&1
echo "kernel alone rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -o '"logits": "[a-z]*", "batch": [0-9]*\|[a-z_]*/kernel:[a-z]*_over_greedy_us": [0-9.]*' $out/x/kernel_alone.log | tee -a $log
t0=$(date +%s)
timeout 120 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp-grid temp-cdf reset-grid-state reset-cdf-state \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
