#!/usr/bin/env bash
# session 24 call 5: sampler.cu's pop_head helper (the PTX of the grid top-k builds differs from
# 76eb17d only in the operand order of commutative predicate and/or): the grid and merge GPU tests
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call5.log
t0=$(date +%s)
timeout 330 python3 -m pytest tests/test_sampling_gpu.py -k "grid or merge_variant" -p no:cacheprovider -q -rf --durations=5 > $out/t_gpu.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -15 $out/t_gpu.log | tee -a $log
