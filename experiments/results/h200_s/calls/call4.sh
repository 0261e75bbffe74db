#!/usr/bin/env bash
# session 21 call 4: decode_unroll 1 / 8 interleaved twice more at batch 1 (256 tokens), bf16
# at batch 1 (1 and 8) for the NVFP4 ratio, and the decode_unroll tests on the GPU
set -uo pipefail
out=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call4.log
t0=$(date +%s)
PYTHONPATH=. timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp-reject --decode-unroll 1 8 1 8 \
  --out $out/decode_unroll_b1.json > $out/decode_b1.log 2>&1
echo "decode nvfp4 b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b1.log | tee -a $log
t0=$(date +%s)
PYTHONPATH=. timeout 90 python3 experiments/bench_decode.py --modes bf16 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy --decode-unroll 1 8 \
  --out $out/decode_bf16_b1.json > $out/decode_bf16.log 2>&1
echo "decode bf16 b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_bf16.log | tee -a $log
t0=$(date +%s)
PYTHONPATH=. timeout 50 python3 -m pytest tests/test_generate.py -k decode_unroll -p no:cacheprovider > $out/t_unroll.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_unroll.log
