#!/usr/bin/env bash
# session 21 call 3: Config.decode_unroll (steps per predicate check; the sampler back at the
# start of the body) at batch 1 (k = 1 8 4 1 8 in one process, 512 tokens) and 64; the
# previous commit (c062d3c) at batch 1 in the same call
set -uo pipefail
out=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
t0=$(date +%s)
PYTHONPATH=. timeout 240 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 512 --repeats 3 \
  --no-breakdown --samplers greedy reset temp-reject --decode-unroll 1 8 4 1 8 \
  --out $out/decode_unroll_b1.json > $out/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b1.log | tee -a $log
t0=$(date +%s)
(cd experiments/tmp_calls/base && PYTHONPATH=. timeout 60 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 512 --repeats 3 \
  --no-breakdown --samplers greedy reset temp-reject \
  --out $out/decode_base_b1.json > $out/decode_base.log 2>&1)
echo "decode base rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_base.log | tee -a $log
t0=$(date +%s)
PYTHONPATH=. timeout 120 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy reset --decode-unroll 1 8 \
  --out $out/decode_unroll_b64.json > $out/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_b64.log | tee -a $log
t0=$(date +%s)
mkdir -p /tmp/tr3
PYTHONPATH=. timeout 90 python3 experiments/profile_step.py --layers 36 --steps 24 --variant nvfp4:1 \
  --variant nvfp4:1:decode_unroll=8 --variant nvfp4:1:sampler=reset:decode_unroll=8 --trace-dir /tmp/tr3 \
  --out $out/profile_unroll.json > $out/profile_unroll.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^\[" $out/profile_unroll.log | tee -a $log
tar -cf $out/traces3.tar -C /tmp tr3
for f in /tmp/tr3/*.gz; do python3 experiments/trace_timeline.py $f --step 12 --skip-ms 8 > /tmp/tl.txt 2>&1; head -8 /tmp/tl.txt; done
