#!/usr/bin/env bash
# session 51 call 5: [T2-E] on the 36-layer decode loop under the default ("auto", head logits),
# every sampler alternated with greedy (A B A C A D ...) so drift between runs cancels: batch 1
# (256 new tokens) and batch 64 (128 new tokens), medians of 5 per entry
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call5.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
run() {  # name batch gen-len samplers...
  local name=$1 b=$2 n=$3 t0=$(date +%s)
  shift 3
  timeout 280 python3 experiments/bench_decode.py --modes nvfp4 --batch $b --gen-len $n --repeats 5 \
    --no-breakdown --samplers "$@" --logits-dtypes head --out $out/x/$name.json > $out/x/$name.log 2>&1
  echo "$name rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -E "ms/token|rror" $out/x/$name.log | tee -a $log
}
ab="greedy temp greedy reset greedy topk20"
run decode_b1_abab 1 256 $ab $ab greedy
run decode_b64_abab 64 128 $ab $ab greedy
tar czf $out/x.tgz -C $out x && rm -rf $out/x
