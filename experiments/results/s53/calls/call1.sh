#!/usr/bin/env bash
# session 53 call 1 (about 9 min; the scripts and patch it names are at commit 6c3e116): sampler_fold_step.patch's GPU tests (fold_step_run.sh tests);
# then, if they pass, on an H200: [T2-E]'s acceptance row (../../s51/calls/call5.sh) on the
# patched tree; on another card: the patch's profile step instead.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu" | tee -a $log
mkdir -p $out/fold
bash experiments/kernels/fold_step_run.sh $out/fold tests
cat $out/fold/fold_step.log >> $log
if ! grep -q "tests rc=0" $out/fold/fold_step.log; then
  echo "fold tests failed: stop" | tee -a $log
  exit 0
fi
if echo "$gpu" | grep -q H200; then
  git apply experiments/kernels/sampler_fold_step.patch
  bash experiments/results/s51/calls/call5.sh $out
  git apply -R experiments/kernels/sampler_fold_step.patch
else
  bash experiments/kernels/fold_step_run.sh $out/fold profile
  cat $out/fold/fold_step.log >> $log
fi
