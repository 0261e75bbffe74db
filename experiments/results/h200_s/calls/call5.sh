#!/usr/bin/env bash
# session 21 call 5: the decode loop under the decode_unroll 8 default on the GPU (the batch-16
# two-layer decode against the CPU run)
set -uo pipefail
out=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
PYTHONPATH=. timeout 55 python3 -m pytest tests/test_kernels_gpu.py -k batch16 -p no:cacheprovider -rA > $out/t_b16.log 2>&1
echo "pytest rc=$?" | tee -a $out/t_b16.log
grep -E "PASSED|FAILED|passed|failed|^E  " $out/t_b16.log | head
