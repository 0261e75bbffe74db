#!/usr/bin/env bash
# session 23 call 2: the grid-state GPU test with newline tokens near the top; the decode step's
# kernels outside the layers for greedy / Temperature / ReSET / ReSET with its state in the grid
# launch (profile_step, 2 layers, batch 1); ncu per-SASS counters of the grid kernel at 64 rows on
# flat logits; the grid's CTA shape at 64 rows (kernel alone)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
mkdir -p $out/x
t0=$(date +%s)
timeout 90 python3 -m pytest tests/test_sampling_gpu.py -k "grid_state" -p no:cacheprovider -q -rf > $out/x/t_state.log 2>&1
echo "pytest grid_state rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/x/t_state.log | tee -a $log
t0=$(date +%s)
timeout 120 python3 experiments/profile_step.py --layers 2 --steps 32 --variant nvfp4:1 \
  --variant nvfp4:1:sampler=temp --variant nvfp4:1:sampler=reset --variant nvfp4:1:sampler=reset-grid-state \
  --out $out/profile_samplers_b1.json > $out/x/profile_samplers_b1.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
t0=$(date +%s)
timeout 150 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section InstructionStats --section SourceCounters \
  --section Occupancy -o $out/x/grid64 \
  python3 experiments/bench_sampler.py --batch 64 --logits flat --methods kernel-grid \
  --samplers temperature_top_p --steps 2 --repeats 1 --out $out/x/ncu_sampler.json > $out/x/ncu_run.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
ncu -i $out/x/grid64.ncu-rep --page details --csv > $out/x/grid64_details.csv 2>&1
ncu -i $out/x/grid64.ncu-rep --page source --csv --print-source sass > $out/x/grid64_sass.csv 2>&1 \
  || ncu -i $out/x/grid64.ncu-rep --page source --csv > $out/x/grid64_sass.csv 2>&1
echo "sass csv lines $(wc -l < $out/x/grid64_sass.csv)" | tee -a $log
head -c 600 $out/x/grid64_sass.csv | tee -a $log; echo | tee -a $log
for shape in "256 4" "256 2" "512 2" "128 8"; do
  set -- $shape
  sed -i "s/^GRID_THREADS = .*/GRID_THREADS = $1/; s/^GRID_CTAS_PER_SM = .*/GRID_CTAS_PER_SM = $2/" cuda_ops/sampler.py
  t0=$(date +%s)
  timeout 45 python3 experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel \
    --variants grid --samplers temperature_top_p \
    --out $out/x/sampler_shape_$1_$2.json > $out/x/sampler_shape_$1_$2.log 2>&1
  echo "grid shape threads=$1 ctas/SM=$2 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A5 "us over greedy" $out/x/sampler_shape_$1_$2.log | tee -a $log
done
git checkout cuda_ops/sampler.py 2>/dev/null || true
tar czf $out/x.tgz -C $out x && rm -rf $out/x
