#!/usr/bin/env bash
# session 57 call 1 (about 5 min), on branch s56-topk-plan (merged into main first): the GPU
# sampler tests of the "grid" variant (46, its top-k path on the plan of at most 64 CTAs a
# row, GRID_TOPK_ROW_CTAS, among them), then that plan against the previous one kernel alone:
# sampler_phases.py's kind topk20 at 1, 2 and 4 rows (the rows it changes), twice ("plan" is
# the new cap; the old plan's CTAs a row as an explicit geometry).
#   [TEST_TIMEOUT=330] [AB_ROWS="1 2 4"] [ROUNDS="1 2"] bash call1.sh OUT SHA
# (the knobs shorten the call when little of a session's device time is left: e.g.
# TEST_TIMEOUT=185 AB_ROWS=1 ROUNDS=1 in about 4 minutes)
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
echo "$(nvidia-smi --query-gpu=name --format=csv,noheader) sha=$sha" | tee -a $log
t0=$(date +%s)
timeout ${TEST_TIMEOUT:-330} python3 -m pytest -q -m gpu tests/test_sampling_gpu.py -k grid \
  > $out/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(($(date +%s) - t0))s" | tee -a $log
tail -4 $out/gpu_tests.log | tee -a $log
for r in ${ROUNDS:-1 2}; do
  for b in ${AB_ROWS:-1 2 4}; do
    old="149x256"; [ $b = 2 ] && old="132x256"; [ $b = 4 ] && old="66x256"
    timeout 40 python3 experiments/kernels/sampler_phases.py --batch $b --variants grid \
      --kinds topk20 --launches 400 --geometries plan $old --out $out/topk_b${b}_r$r.json 2>&1 \
      | cut -c1-110 | tee -a $log
  done
done
