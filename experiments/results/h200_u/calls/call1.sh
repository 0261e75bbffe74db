#!/usr/bin/env bash
# session 23 call 1: [T2-E] the grid-state kernel's GPU test, ReSET with its state in the grid
# launch against the default (adjacent pairs, batch 1 and 64), the grid kernel's phase 1 in one
# online sweep (ONLINE_STATS) against two sweeps (kernel alone, same call) and its GPU tests
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
nvidia-smi --query-gpu=name,clocks.max.sm --format=csv | tee -a $log
t0=$(date +%s)
timeout 110 python3 -m pytest tests/test_sampling_gpu.py -k "grid_state" -p no:cacheprovider -q -rf > $out/t_state.log 2>&1
echo "pytest grid_state rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_state.log | tee -a $log
t0=$(date +%s)
timeout 80 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy reset reset-grid-state greedy reset reset-grid-state \
  --out $out/decode_b1.json > $out/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset reset-grid-state greedy \
  --out $out/decode_b64.json > $out/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b64.log | tee -a $log
for on in 0 1; do
  sed -i "s/^#define ONLINE_STATS [01]$/#define ONLINE_STATS $on/" cuda_ops/sampler.cu
  t0=$(date +%s)
  timeout 60 python3 experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel \
    --variants grid --samplers temperature_top_p reset_top_p \
    --out $out/sampler_online$on.json > $out/sampler_online$on.log 2>&1
  echo "bench_sampler ONLINE_STATS=$on rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A8 "us over greedy" $out/sampler_online$on.log | tee -a $log
done
t0=$(date +%s)
timeout 100 python3 -m pytest tests/test_sampling_gpu.py -k "grid" -p no:cacheprovider -q -rf > $out/t_grid_online.log 2>&1
echo "pytest grid (ONLINE_STATS=1) rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_grid_online.log | tee -a $log
