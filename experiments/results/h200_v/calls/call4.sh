#!/usr/bin/env bash
# session 24 call 4: the 36-layer NVFP4 decode loop under "auto" at 1 and 64 rows, samplers
# alternated three times (greedy, Temperature + top-p, ReSET + top-p, top-k 20 + top-p);
# racecheck on the grid kernel with top-p (last call's run crashed at start)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call4.log
mkdir -p $out/x
t0=$(date +%s)
timeout 90 compute-sanitizer --tool racecheck --kernel-name kns=rejax_sample --print-limit 20 \
  python3 experiments/bench_sampler.py --batch 1 8 --logits flat --methods kernel-grid \
  --samplers temperature_top_p reset_top_p --steps 2 --repeats 1 --out $out/x/san.json > $out/x/san_racecheck_top_p.log 2>&1
echo "sanitizer racecheck top-p rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "RACECHECK SUMMARY|hazard|over greedy" -A3 $out/x/san_racecheck_top_p.log | head -8 | tee -a $log
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 greedy temp reset topk20 greedy temp reset topk20 \
  --out $out/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 greedy temp reset topk20 greedy temp reset topk20 \
  --out $out/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
