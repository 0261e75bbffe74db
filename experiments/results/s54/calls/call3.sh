#!/usr/bin/env bash
# session 54 call 3: [T2-E]'s acceptance measurement on this tree, the file the issue names:
# experiments/bench_sampler.py, 36-layer random Qwen3-8B NVFP4 decode loop, batch 1 and 64,
# 128 new tokens, medians of 5 runs an entry, 3 rounds of greedy S1 greedy S2 greedy S3 greedy
# (a sampler's cost is its time minus the mean of the greedy runs beside it; the median over
# rounds), plus the kernel alone on lm logits (about 6 min).
#   bash call3.sh OUT [SHA]   SHA: the local checkout's (the device copy's git metadata is
#                             main's as the session began, not the working tree's commits)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
sha=${2:-$(git rev-parse HEAD)}
t0=$(date +%s)
timeout 570 python3 experiments/bench_sampler.py --batch 1 64 --logits lm --methods kernel \
  --samplers temperature_top_p top_k20_top_p reset_top_p --stats two_pass --steps 20 --repeats 5 \
  --decode-layers 36 --decode-tokens 128 --decode-rounds 3 --git-sha $sha \
  --out $out/bench_sampler_gpu.json > $out/bench_sampler.log 2>&1
echo "bench_sampler rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -a -E '"batch"|rror' $out/bench_sampler.log | cut -c1-1500 | tee -a $log
