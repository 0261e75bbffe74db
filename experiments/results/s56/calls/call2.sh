#!/usr/bin/env bash
# session 57 call 2 (about 2 min): what the batch-1 decode loop copies at each check of its
# predicate. Session 56's traces put a copy thunk and a MemcpyD2D on the host after every
# check (every decode_unroll = 8 steps), before the next iteration's graphs. This compiles the
# 36-layer NVFP4 decode loop (profile_step.py, greedy and ReSET) with XLA's dumps on, then lists
# the copies at the top level of each while loop's body (experiments/hlo_loop_copies.py) and
# keeps the optimized modules gzipped.
#   bash call2.sh OUT
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
XLA_FLAGS="--xla_dump_to=/tmp/hlo --xla_dump_hlo_as_text --xla_dump_hlo_module_re=.*decode_loop.*" \
  timeout 240 python3 experiments/profile_step.py --layers 36 --prompt-len 128 --steps 16 \
  --variant nvfp4:1:sampler=greedy --variant nvfp4:1:sampler=reset \
  --out $out/profile.json > $out/profile.log 2>&1
echo "profile rc=$? $(($(date +%s) - t0))s" | tee -a $log
mkdir -p $out/hlo
for f in /tmp/hlo/*decode_loop*after_optimizations.txt; do
  [ -e "$f" ] || { echo "no optimized decode_loop module in /tmp/hlo" | tee -a $log; break; }
  b=$(basename $f .txt)
  echo "== $b ($(wc -c < $f) bytes)" | tee -a $log
  python3 experiments/hlo_loop_copies.py $f --json $out/hlo/$b.copies.json 2>&1 | cut -c1-200 \
    | head -60 | tee -a $log
  gzip -c $f > $out/hlo/$b.txt.gz
done
ls /tmp/hlo | head -20 >> $log
