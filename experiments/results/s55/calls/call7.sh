#!/usr/bin/env bash
# session 55 call 7 (next session; about 2 min): where the batch-1 decode loop's idle sits, per
# executable. Session 55's 36-layer profile (call 2) put greedy / ReSET / Temperature within
# 1.5-8.6 us of GPU busy time a step while their wall ms/token moved by up to 78 us, the
# difference idle gaps around host copies (MemcpyD2D / MemcpyH2D, 3-4 in 32 steps: one a
# predicate check, every decode_unroll = 8 steps; up to 0.8 ms each). This keeps each variant's trace and reads it back with trace_timeline.py
# (steady-state idle per step, the idle of every step, and the host events of the idlest step:
# a predicate check), so each gap is tied to
# the host work it waits for.
#   bash call7.sh OUT
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call7.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 300 python3 experiments/profile_step.py --layers 36 --prompt-len 128 --steps 64 \
  --variant nvfp4:1:sampler=greedy --variant nvfp4:1:sampler=reset \
  --variant nvfp4:1:sampler=greedy --variant nvfp4:1:sampler=temp \
  --trace-dir $out/traces --out $out/profile_36l_b1_64.json > $out/profile.log 2>&1
echo "profile rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -aE "^\[|idle" $out/profile.log | cut -c1-160 | tee -a $log
for t in $out/traces/*.trace.json.gz; do
  echo "== $(basename $t)" | tee -a $log
  timeout 60 python3 experiments/trace_timeline.py $t --step -1 2>&1 | head -90 | tee -a $log
done
rm -rf $out/traces  # tens of MB each; the summaries above are kept
