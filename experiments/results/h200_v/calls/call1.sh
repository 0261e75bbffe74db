#!/usr/bin/env bash
# session 24 call 1: the grid sampler with batched block reductions and its own top-k (both
# patches applied): GPU tests; kernel alone top-p ABAB against HEAD's sources (swapped in);
# top-k 20 grid vs split vs merge; the decode loop at batch 1 (top-k 20 by variant)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
mkdir -p $out/x /tmp/new
t0=$(date +%s)
timeout 240 python3 -m pytest tests/test_sampling_gpu.py -k "grid or merge_variant or emulation or chi or default_auto" -p no:cacheprovider -q -rf > $out/x/t_gpu.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|FAILED|Error" $out/x/t_gpu.log | tail -15 | tee -a $log
for f in cuda_ops/sampler.cu cuda_ops/sampler.py rejax/ops/sampler.py; do cp $f /tmp/new/$(echo $f | tr / _); done
swap() {  # $1 = head | new
  for f in cuda_ops/sampler.cu cuda_ops/sampler.py rejax/ops/sampler.py; do
    g=$(echo $f | tr / _)
    if [ $1 = head ]; then cp experiments/tmp_calls/head/$g $f; else cp /tmp/new/$g $f; fi
  done
}
for run in head new head new; do
  swap $run
  t0=$(date +%s)
  timeout 60 python3 experiments/bench_sampler.py --batch 1 8 64 --logits lm flat --methods kernel-grid \
    --samplers temperature_top_p reset_top_p --stats two_pass \
    --out $out/x/sampler_$run.json > $out/x/sampler_$run.log 2>&1
  echo "bench_sampler $run rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A7 "us over greedy" $out/x/sampler_$run.log | tee -a $log
  cp $out/x/sampler_$run.json $out/x/sampler_${run}_$(date +%s).json
done
swap new
for rep in 1 2; do
  t0=$(date +%s)
  timeout 80 python3 experiments/bench_sampler.py --batch 1 8 64 --logits lm flat \
    --methods kernel-grid kernel-split kernel-merge --samplers top_k20_top_p \
    --out $out/x/topk_$rep.json > $out/x/topk_$rep.log 2>&1
  echo "bench_sampler topk $rep rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A7 "us over greedy" $out/x/topk_$rep.log | tee -a $log
done
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20-grid topk20-split greedy temp reset topk20-grid topk20-split \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token|rror" $out/x/decode_b1.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
