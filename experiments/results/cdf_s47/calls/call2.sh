#!/usr/bin/env bash
# session 47 call 2: the "cdf" variant's chi-square GPU tests, then the 36-layer NVFP4 decode loop
# at 1 row with grid and cdf alternated (greedy first in each round)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 130 python3 -m pytest -q tests/test_sampling_gpu.py -k "cdf and chi_square" -p no:cacheprovider \
  > $out/x/gpu_tests_cdf_chi.log 2>&1
echo "gpu tests cdf chi-square rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -5 $out/x/gpu_tests_cdf_chi.log | tee -a $log
t0=$(date +%s)
timeout 150 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp-grid temp-cdf reset-grid-state reset-cdf-state \
  greedy temp-grid temp-cdf reset-grid-state reset-cdf-state \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
