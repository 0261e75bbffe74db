#!/usr/bin/env bash
# session 49 (call 1 cut to the GPU tests alone, for the last minutes of device time): the GPU
# tests of "cdf", "auto" and bfloat16 logits
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1t.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 120 python3 -m pytest -q tests/test_sampling_gpu.py -x \
  -k "(cdf and not chi_square) or default_auto or bfloat16" -p no:cacheprovider > $out/x/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "passed|failed|Error|assert" $out/x/gpu_tests.log | tail -8 | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
