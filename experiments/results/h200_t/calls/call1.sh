#!/usr/bin/env bash
# session 22 call 1: [T2-B] linear_fusion split / mixed / fused at batch 1 (36 layers, adjacent
# triplets twice) with bf16 once; per-kernel profiles of the three and of the samplers ([T2-E]);
# the tiny-model generation tests of fused-b4 / mixed-b4 on the GPU
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/bench_decode.py --modes nvfp4 bf16 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy --linear-fusion split mixed fused split mixed fused \
  --out $out/decode_lf_b1.json > $out/decode_lf.log 2>&1
echo "decode lf b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_lf.log | tee -a $log
t0=$(date +%s)
timeout 170 python3 experiments/profile_step.py --steps 16 \
  --variant nvfp4:1 --variant nvfp4:1:linear_fusion=fused --variant nvfp4:1:linear_fusion=mixed \
  --variant nvfp4:1:sampler=temp-reject --variant nvfp4:1:sampler=reset-reject --variant nvfp4:1:sampler=reset \
  --out $out/profile_b1.json > $out/profile_b1.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_fused_linear_gpu.py -k "fused-b4 or mixed-b4" -p no:cacheprovider -x -q > $out/t_tiny.log 2>&1
echo "pytest tiny rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_tiny.log | tee -a $log
