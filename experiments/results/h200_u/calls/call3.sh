#!/usr/bin/env bash
# session 23 call 3: ncu per-SASS counters of the grid kernel at 64 rows on flat logits (call 2's
# export crashed at start)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
mkdir -p $out/x
args="experiments/bench_sampler.py --batch 64 --logits flat --methods kernel-grid --samplers temperature_top_p --steps 2 --repeats 1 --out $out/x/ncu_sampler.json"
t0=$(date +%s)
timeout 120 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SourceCounters --section InstructionStats --page source --csv --print-source sass \
  python3 $args > $out/x/grid64_sass.csv 2> $out/x/ncu_a.err
echo "ncu source rc=$? $(( $(date +%s)-t0 ))s lines $(wc -l < $out/x/grid64_sass.csv)" | tee -a $log
tail -3 $out/x/ncu_a.err | tee -a $log
t0=$(date +%s)
timeout 120 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SpeedOfLight --section WarpStateStats --section InstructionStats --section Occupancy \
  python3 $args > $out/x/grid64_details.log 2>&1
echo "ncu details rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "Duration|Throughput|Issued|Executed Ipc|Occupancy|Registers|Stall|cycles" $out/x/grid64_details.log | head -30 | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
