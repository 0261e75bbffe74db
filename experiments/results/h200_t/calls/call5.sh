#!/usr/bin/env bash
# session 22 call 5: generate on the GPU under the new sampler default (grid for top-p): its
# sampling tests; [T2-B] the layer scan's unroll 4 / 9 at batch 8 and 64 (batch 1: call 4)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call5.log
t0=$(date +%s)
timeout 170 python3 -m pytest tests/test_generate.py -k "deterministic or reset or stream_matches or decode_unroll" -p no:cacheprovider -q -rf > $out/t_generate.log 2>&1
echo "pytest generate rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|FAILED|Error" $out/t_generate.log | tail -8 | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/bench_decode.py --modes nvfp4 --batch 8 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy --scan-unroll 4 9 4 9 \
  --out $out/decode_su_b8_b64.json > $out/decode_su.log 2>&1
echo "decode su b8/b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_su.log | tee -a $log
