#!/usr/bin/env bash
# session 55 call 1: the grid sampler ("cdf", bfloat16 lm logits, kernel alone, CuPy) at other
# launch shapes, phase by phase (sampler_phases.py --geometries): 1 row over 8-149 CTAs, with
# global-memory barriers or as one thread-block cluster (GRID_CLUSTER), and 64 rows as the plan
# or as clusters; then, on an H200, [T2-E]'s acceptance file (s54 call3.sh).
#   bash call1.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)
echo "$gpu sha=$sha" | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/kernels/sampler_phases.py --batch 1 --variants cdf \
  --geometries plan 8x1024c 8x1024 8x512c 16x1024 16x512 32x512 64x256 \
  --out $out/phases_b1.json 2>&1 | tee -a $log
timeout 100 python3 experiments/kernels/sampler_phases.py --batch 64 --variants cdf \
  --geometries plan 8x256c 8x512c 8x128c --out $out/phases_b64.json 2>&1 | tee -a $log
echo "phases $(($(date +%s) - t0))s" | tee -a $log
case "$gpu" in
  *H200*) bash experiments/results/s54/calls/call3.sh $out $sha ;;
esac
