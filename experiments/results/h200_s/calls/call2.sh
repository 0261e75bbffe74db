#!/usr/bin/env bash
# session 21 call 2: kernel + host timelines (Perfetto traces) of the decode loop, new loop
# (sampling at the end of the body; 1 and 8 steps per check) against the previous commit's;
# the two test_generate cases that failed on the GPU, new and previous commit
set -uo pipefail
out=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
mkdir -p /tmp/tr_new /tmp/tr_base
t0=$(date +%s)
PYTHONPATH=. timeout 120 python3 experiments/profile_step.py --layers 36 --steps 12 --variant nvfp4:1 \
  --variant nvfp4:1:decode_unroll=8 --variant nvfp4:1:sampler=reset --trace-dir /tmp/tr_new \
  --out $out/profile_new.json > $out/profile_new.log 2>&1
echo "profile new rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^\[" $out/profile_new.log | tee -a $log
t0=$(date +%s)
(cd experiments/tmp_calls/base && PYTHONPATH=. timeout 90 python3 experiments/profile_step.py --layers 36 --steps 12 --variant nvfp4:1 \
  --variant nvfp4:1:sampler=reset --trace-dir /tmp/tr_base \
  --out $out/profile_base.json > $out/profile_base.log 2>&1)
echo "profile base rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^\[" $out/profile_base.log | tee -a $log
tar -cf $out/traces.tar -C /tmp tr_new tr_base; ls -la $out/traces.tar | tee -a $log
for tree in . experiments/tmp_calls/base; do
  t0=$(date +%s)
  (cd $tree && PYTHONPATH=. timeout 100 python3 -m pytest tests/test_generate.py -x -q --tb=short -p no:cacheprovider \
    -k "deterministic_for_a_key or reset_inside_generate" > /tmp/t.log 2>&1; echo "rc=$?" >> /tmp/t.log)
  echo "== $tree $(( $(date +%s)-t0 ))s" >> $out/t_generate.log; cat /tmp/t.log >> $out/t_generate.log
done
grep -E "^(FAILED|ERROR)|^E  |rc=|passed|failed|^==" $out/t_generate.log | cut -c1-300 | head -40
