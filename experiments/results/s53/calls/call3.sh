#!/usr/bin/env bash
# session 53 call 3: on an H200, the fold's GPU tests (call2.sh's step 1) and then [T2-E]'s
# acceptance row on this tree (../../s51/calls/call5.sh: 36-layer NVFP4 decode loop, batch 1
# and 64, every sampler alternated with greedy, medians of 5 an entry; about 6.5 min); on
# another card, call2.sh.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
if ! echo "$gpu" | grep -q H200; then
  exec bash experiments/results/s53/calls/call2.sh $out
fi
log=$out/call3.log
echo "$gpu" | tee -a $log
mkdir -p $out/t
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_sample_step.py tests/test_sampling_gpu.py -k \
  "fold_the_step or not test_sampling_gpu" -p no:cacheprovider -rfs > $out/t/tests.log 2>&1
echo "tests rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -a -E "passed|failed|FAILED|SKIPPED|Error" $out/t/tests.log | tail -15 | tee -a $log
bash experiments/results/s51/calls/call5.sh $out
