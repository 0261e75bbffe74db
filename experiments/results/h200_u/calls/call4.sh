#!/usr/bin/env bash
# session 23 call 4: the grid kernel with a block-wide floor in its scoring sweep and one 64-bit
# rank compare in its mass sweep: GPU tests; kernel alone against the previous source (HEAD's
# sampler.cu swapped in; ABAB in one call); the decode loop at 64 and 1 rows; ncu per-SASS
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call4.log
mkdir -p $out/x
t0=$(date +%s)
timeout 120 python3 -m pytest tests/test_sampling_gpu.py -k "grid" -p no:cacheprovider -q -rf > $out/x/t_grid.log 2>&1
echo "pytest grid rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/x/t_grid.log | tee -a $log
cp cuda_ops/sampler.cu /tmp/sampler_new.cu
for run in base new base new; do
  if [ $run = base ]; then cp experiments/tmp_calls/sampler_head.cu cuda_ops/sampler.cu; else cp /tmp/sampler_new.cu cuda_ops/sampler.cu; fi
  t0=$(date +%s)
  timeout 50 python3 experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel \
    --variants grid --samplers temperature_top_p reset_top_p --stats two_pass \
    --out $out/x/sampler_$run.json > $out/x/sampler_$run.log 2>&1
  echo "bench_sampler $run rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A5 "us over greedy" $out/x/sampler_$run.log | tee -a $log
  cp $out/x/sampler_$run.json $out/x/sampler_${run}_$(date +%s).json
done
cp /tmp/sampler_new.cu cuda_ops/sampler.cu
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp reset greedy temp \
  --out $out/x/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/x/decode_b64.log | tee -a $log
t0=$(date +%s)
timeout 80 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset reset-grid-state greedy temp reset reset-grid-state \
  --out $out/x/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/x/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 60 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SourceCounters --section InstructionStats --section SpeedOfLight --page source --csv --print-source sass \
  python3 experiments/bench_sampler.py --batch 64 --logits flat --methods kernel-grid --samplers temperature_top_p \
  --steps 2 --repeats 1 --stats two_pass --out $out/x/ncu_sampler.json > $out/x/grid64_sass.csv 2> $out/x/ncu.err
echo "ncu rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
