#!/usr/bin/env bash
# session 58 call 1 (about 6-8 min), on branch s58-topk-tau (which holds s56-topk-plan): the
# GPU tests and kernel-alone A/Bs of both top-k changes to the grid sampler:
#  1. s56/calls/call1.sh with one A/B round: the 46 GPU tests of the "grid" sampler (top-k 20 /
#     30 on "real", "ties" and "equal" rows among them), then the top-k plan of at most 64 CTAs
#     a row against the old geometry at 1, 2 and 4 rows;
#  2. the branch's two changes to the top-k path after the plan, kernel alone: sampler_phases.py
#     kind topk20 at 1, 8 and 64 rows, three builds alternated twice: the branch's defaults
#     (tau by 32-bit warp maxima, TAU_SELECT=1; a thread lists its own max unless its second
#     largest reaches tau, LIST_OWN=1), LIST_OWN=0 (every thread sweeps again), and both 0 (the
#     previous code). The tokens must agree; "combined->arrive2" (the phase holding both) should
#     shrink by several us at 1 row.
# Then call2.sh (the decode loop's GPU HLO copies) in a call of its own.
#   [TEST_TIMEOUT=300] [ROUNDS=1] bash call1.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
TEST_TIMEOUT=${TEST_TIMEOUT:-300} ROUNDS=${ROUNDS:-1} \
  bash experiments/results/s56/calls/call1.sh $out $sha
log=$out/call1.log
for r in 1 2; do
  for build in new own0 old; do
    case $build in
      new) defs="" ;;
      own0) defs="--define LIST_OWN=0" ;;
      old) defs="--define LIST_OWN=0 --define TAU_SELECT=0" ;;
    esac
    timeout 60 python3 experiments/kernels/sampler_phases.py --batch 1 8 64 --variants grid \
      --kinds topk20 --launches 400 $defs --out $out/topk_${build}_r$r.json 2>&1 \
      | cut -c1-170 | tee -a $log
  done
done
