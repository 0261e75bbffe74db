#!/usr/bin/env bash
# session 24 call 2: the grid top-k under "auto": remaining GPU tests; top-k 20 and 64 grid vs
# split alone; the 36-layer decode loop at 64 and 1 rows (topk20 = auto = grid vs split);
# compute-sanitizer memcheck / racecheck on the grid kernel with top-k and with top-p
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
mkdir -p $out/x
t0=$(date +%s)
timeout 200 python3 -m pytest tests/test_sampling_gpu.py -k "no_retrace or reset_decisions or default_auto" -p no:cacheprovider -q -rf > $out/x/t_gpu.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|FAILED|Error" $out/x/t_gpu.log | tail -15 | tee -a $log
t0=$(date +%s)
timeout 80 python3 experiments/bench_sampler.py --batch 1 8 64 --logits lm flat \
  --methods kernel-grid kernel-split --samplers top_k20_top_p top_k64_top_p \
  --out $out/x/topk.json > $out/x/topk.log 2>&1
echo "bench_sampler topk rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -A7 "us over greedy" $out/x/topk.log | tee -a $log
t0=$(date +%s)
timeout 130 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 topk20-split greedy temp reset topk20 topk20-split \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b64.log | tee -a $log
t0=$(date +%s)
timeout 80 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 greedy temp reset topk20 \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
for tool in memcheck racecheck; do
  for s in top_k20_top_p temperature_top_p; do
    t0=$(date +%s)
    timeout 70 compute-sanitizer --tool $tool --kernel-name kss=rejax_sample --print-limit 20 \
      python3 experiments/bench_sampler.py --batch 1 8 --logits flat --methods kernel-grid \
      --samplers $s --steps 2 --repeats 1 --out $out/x/san.json > $out/x/san_${tool}_$s.log 2>&1
    echo "sanitizer $tool $s rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard" $out/x/san_${tool}_$s.log | head -5 | tee -a $log
  done
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
