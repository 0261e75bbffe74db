#!/usr/bin/env bash
# session 55 call 6: "cdf"'s smaller plan at up to 8 rows (CDF_ROW_CTAS, CDF_SMALL_CTAS_PER_SM)
# through XLA against the previous plan (the same tree with CDF_ROW_CTAS = 256 and
# CDF_SMALL_BATCH = 0, which is grid_plan's), new then old: bench_sampler's
# kernel alone on bfloat16 lm logits at 1, 4 and 8 rows; then the GPU sampler tests of "cdf".
#   bash call6.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call6.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
bench() {  # name patch
  local t0=$(date +%s)
  timeout 75 python3 -c "
import runpy, sys
import cuda_ops.sampler as k
$2
sys.argv = ['bench_sampler.py', '--batch', '1', '4', '8', '--logits', 'lm', '--logits-dtype', 'bfloat16',
            '--methods', 'kernel', '--samplers', 'temperature_top_p', 'reset_top_p', '--stats', 'two_pass',
            '--steps', '20', '--repeats', '5', '--git-sha', '$sha', '--out', '$out/ab_$1.json']
runpy.run_path('experiments/bench_sampler.py', run_name='__main__')
" > $out/ab_$1.log 2>&1
  echo "$1 rc=$? $(($(date +%s) - t0))s" | tee -a $log
  grep -a '"batch"' $out/ab_$1.log | cut -c1-400 | tee -a $log
}
bench new1 "pass"
bench old1 "k.CDF_ROW_CTAS = 256; k.CDF_SMALL_BATCH = 0"
t0=$(date +%s)
timeout 110 python3 -m pytest -q -m gpu tests/test_sampling_gpu.py -k "cdf" -x > $out/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(($(date +%s) - t0))s" | tee -a $log
tail -5 $out/gpu_tests.log | tee -a $log
