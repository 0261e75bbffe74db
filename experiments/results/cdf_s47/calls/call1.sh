#!/usr/bin/env bash
# session 47 call 1: the "cdf" sampler variant's GPU tests, then kernel alone (grid vs cdf,
# Temperature / ReSET + top-p at 1 / 8 / 64 rows, lm and flat logits), then the 36-layer NVFP4
# decode loop at 64 rows with grid and cdf alternated (greedy first in each round)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
mkdir -p $out/x
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 150 python3 -m pytest -q -x tests/test_sampling_gpu.py -k "cdf and not chi_square" -p no:cacheprovider \
  > $out/x/gpu_tests_cdf.log 2>&1
echo "gpu tests cdf rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -5 $out/x/gpu_tests_cdf.log | tee -a $log
t0=$(date +%s)
timeout 90 python3 experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel \
  --variants grid cdf --samplers temperature_top_p reset_top_p --stats two_pass \
  --out $out/x/kernel_alone.json > $out/x/kernel_alone.log 2>&1
echo "kernel alone rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "over greedy|us" $out/x/kernel_alone.log | tail -30 | tee -a $log
t0=$(date +%s)
timeout 180 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp-grid temp-cdf reset-grid-state reset-cdf-state \
  greedy temp-grid temp-cdf reset-grid-state reset-cdf-state \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
