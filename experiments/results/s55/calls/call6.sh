#!/usr/bin/env bash
# session 55 call 6 (about 4 min): the GPU sampler tests of "cdf" on its smaller plan at up to
# 8 rows (CDF_ROW_CTAS, CDF_SMALL_CTAS_PER_SM); the grid kernel's top-k 20 path (what "auto"
# runs for top-k 20) at fewer CTAs a row (sampler_phases.py, kind topk20); then the new plan
# through XLA against the previous one (the same tree with CDF_ROW_CTAS = 256 and
# CDF_SMALL_BATCH = 0, grid_plan's), bench_sampler's kernel alone on bfloat16 lm logits,
# Temperature + top-p at 1, 4 and 8 rows, new then old.
#   bash call6.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call6.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 90 python3 -m pytest -q -m gpu tests/test_sampling_gpu.py -k "cdf and not chi_square" \
  > $out/gpu_tests.log 2>&1
echo "gpu tests rc=$? $(($(date +%s) - t0))s" | tee -a $log
tail -4 $out/gpu_tests.log | tee -a $log
for b in 1 8; do
  g="plan 64x256 32x256"; [ $b = 8 ] && g="plan 16x256 24x256"
  timeout 40 python3 experiments/kernels/sampler_phases.py --batch $b --variants grid \
    --kinds topk20 --launches 400 --geometries $g --out $out/topk_b$b.json 2>&1 | cut -c1-110 | tee -a $log
done
bench() {  # name patch
  local t0=$(date +%s)
  timeout 55 python3 -c "
import runpy, sys
import cuda_ops.sampler as k
$2
sys.argv = ['bench_sampler.py', '--batch', '1', '4', '8', '--logits', 'lm', '--logits-dtype', 'bfloat16',
            '--methods', 'kernel', '--samplers', 'temperature_top_p', '--stats', 'two_pass',
            '--steps', '20', '--repeats', '5', '--git-sha', '$sha', '--out', '$out/ab_$1.json']
runpy.run_path('experiments/bench_sampler.py', run_name='__main__')
" > $out/ab_$1.log 2>&1
  echo "$1 rc=$? $(($(date +%s) - t0))s" | tee -a $log
  grep -a '"batch"' $out/ab_$1.log | cut -c1-300 | tee -a $log
}
bench new "pass"
bench old "k.CDF_ROW_CTAS = 256; k.CDF_SMALL_BATCH = 0"
