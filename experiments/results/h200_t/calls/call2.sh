#!/usr/bin/env bash
# session 22 call 2: [T2-E] the "grid" sampler variant: its GPU tests, the kernel alone against
# "reject" / "merge", and the 36-layer decode loop over greedy at batch 1 and 64
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
t0=$(date +%s)
timeout 230 python3 -m pytest tests/test_sampling_gpu.py -k grid -p no:cacheprovider -q -rf > $out/t_grid.log 2>&1
echo "pytest grid rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|FAILED|Error" $out/t_grid.log | tail -25 | tee -a $log
t0=$(date +%s)
timeout 120 python3 experiments/bench_sampler.py --batch 1 8 64 --logits lm --methods kernel \
  --variants reject grid merge --samplers temperature_top_p reset_top_p \
  --out $out/sampler_grid.json > $out/sampler_grid.log 2>&1
echo "bench_sampler rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -iE "kernel|greedy" $out/sampler_grid.log | tail -30 | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp-grid reset-grid temp-reject reset-reject \
  --out $out/decode_b1.json > $out/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 150 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp-grid reset-grid reset temp \
  --out $out/decode_b64.json > $out/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b64.log | tee -a $log
