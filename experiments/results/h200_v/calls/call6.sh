#!/usr/bin/env bash
# session 24 call 6: ncu per-SASS counters of the grid kernel at d1efcdf, 64 rows: Temperature
# + top-p on flat and lm logits, ReSET + top-p ("auto": grid-state) on flat logits; CSVs gzipped
# for experiments/ncu_sass_segments.py
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call6.log
run() {  # name logits method sampler
  local t0=$(date +%s)
  timeout 45 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section InstructionStats --page source --csv --print-source sass \
    python3 experiments/bench_sampler.py --batch 64 --logits $2 --methods $3 --samplers $4 \
    --steps 2 --repeats 1 --out /tmp/ncu_$1.json > $out/$1_sass.csv 2> $out/$1.err
  echo "ncu $1 rc=$? $(( $(date +%s)-t0 ))s lines $(wc -l < $out/$1_sass.csv)" | tee -a $log
  gzip -9 $out/$1_sass.csv
}
run grid64_flat_temp flat kernel-grid temperature_top_p
run grid64_flat_reset flat kernel reset_top_p
run grid64_lm_temp lm kernel-grid temperature_top_p
tar czf $out/errs.tgz -C $out $(cd $out && ls *.err) && rm -f $out/*.err
