#!/usr/bin/env bash
# session 50 call 3 (s48's GPU tests passed in calls 1-2): the decode loop at 1 row (head /
# float32 logits) and at 64 rows (greedy, Temperature and ReSET "cdf", top-k 20; head logits),
# then the stash patch's GPU tests and its kernel-alone timings against the tree (bfloat16
# logits, 32 / 64 rows). The session ran the two halves as two calls (the stash script empties
# $out/x when it ends, so it runs last here).
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 110 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp-cdf reset-cdf-state --logits-dtypes head float32 \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 5 \
  --no-breakdown --samplers greedy temp-cdf reset-cdf-state topk20 --logits-dtypes head \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
bash experiments/kernels/stash_patch_run.sh $out tests abab
