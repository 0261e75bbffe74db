#!/usr/bin/env bash
# session 20 call 3: GPU tests after the chunk_best refactor and under the KT 256 GEMM default
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
t0=$(date +%s)
timeout 170 python3 -m pytest -m gpu tests/test_sampling_gpu.py -k "reject or cluster" -q -rfE -p no:cacheprovider > $out/t_sampling.log 2>&1
echo "sampling rc=$? $(( $(date +%s)-t0 ))s $(tail -1 $out/t_sampling.log)" | tee -a $log
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu tests/test_gemm_gpu.py -q -rfE -p no:cacheprovider > $out/t_gemm.log 2>&1
echo "gemm rc=$? $(( $(date +%s)-t0 ))s $(tail -1 $out/t_gemm.log)" | tee -a $log
t0=$(date +%s)
timeout 150 python3 -m pytest -m gpu tests/test_fused_linear_gpu.py -k tiny -q -rfE -p no:cacheprovider > $out/t_tiny.log 2>&1
echo "tiny rc=$? $(( $(date +%s)-t0 ))s $(tail -1 $out/t_tiny.log)" | tee -a $log
grep -hE "^(FAILED|ERROR)" $out/t_*.log | head
