#!/usr/bin/env bash
# session 22 call 6: the grid kernel's sweeps with a floor at the thread's own k-th best score
# (the noise's logarithms skipped below it): GPU tests, kernel alone, the decode loop at 1 and 64
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call6.log
t0=$(date +%s)
timeout 100 python3 -m pytest tests/test_sampling_gpu.py -k "grid" -p no:cacheprovider -q -rf > $out/t_grid.log 2>&1
echo "pytest grid rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_grid.log | tee -a $log
t0=$(date +%s)
timeout 80 python3 experiments/bench_sampler.py --batch 1 64 --logits lm model --model-layers 2 --methods kernel \
  --variants grid merge --samplers temperature_top_p reset_top_p \
  --out $out/sampler_floor.json > $out/sampler_floor.log 2>&1
echo "bench_sampler rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -A6 "us over greedy" $out/sampler_floor.log | tee -a $log
t0=$(date +%s)
timeout 90 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp reset greedy \
  --out $out/decode_b64.json > $out/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b64.log | tee -a $log
t0=$(date +%s)
timeout 70 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset greedy temp reset \
  --out $out/decode_b1.json > $out/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b1.log | tee -a $log
