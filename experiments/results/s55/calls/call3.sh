#!/usr/bin/env bash
# session 55 call 3: "cdf-cluster" (the grid kernel's row as one 8-CTA cluster, its barriers the
# cluster's) against the default ("auto": "cdf", with ReSET's state in the launch) through XLA:
# the kernel alone on bfloat16 lm logits and the 36-layer NVFP4 decode loop, batch 1 and 64,
# 3 rounds of greedy S1 greedy S2 ... greedy (bench_sampler.py), for Temperature and ReSET.
#   bash call3.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 560 python3 experiments/bench_sampler.py --batch 1 64 --logits lm --logits-dtype bfloat16 \
  --methods kernel kernel-cdf-cluster-state --samplers temperature_top_p reset_top_p \
  --stats two_pass --steps 20 --repeats 5 --decode-layers 36 --decode-tokens 128 \
  --decode-rounds 3 --decode-samplers temperature_top_p reset_top_p --git-sha $sha \
  --out $out/bench_sampler_cluster.json > $out/bench_sampler_cluster.log 2>&1
echo "bench_sampler rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -a -E '"batch"|rror' $out/bench_sampler_cluster.log | cut -c1-1500 | tee -a $log
