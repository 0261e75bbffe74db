#!/usr/bin/env bash
# session 54 call 8 (about a minute): experiments/kernels/sampler_phases.py, the grid sampler's
# phases from clock64 / %globaltimer stamps (sampler_phase_ts.patch, applied in a temporary
# copy), "cdf" and "grid", Temperature and ReSET, 1 and 64 rows, bfloat16 lm logits
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm --format=csv,noheader | tee -a $out/call8.log
t0=$(date +%s)
timeout 240 python3 experiments/kernels/sampler_phases.py --batch 1 64 --out $out/phases.json \
  > $out/phases.log 2>&1
echo "phases rc=$? $(($(date +%s) - t0))s" | tee -a $out/call8.log
tail -30 $out/phases.log | cut -c1-600 | tee -a $out/call8.log
