#!/usr/bin/env bash
# session 23 call 5: ReSET's state updated in place by the grid-state kernel (operands aliased
# to results): GPU tests (and a planted bug), the step's copies (profile_step, 2 layers), the
# decode loop at 1 and 64 rows in adjacent repeats; ncu per-SASS of the grid kernel (flat, lm)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call5.log
mkdir -p $out/x
t0=$(date +%s)
timeout 90 python3 -m pytest tests/test_sampling_gpu.py -k "grid_state" -p no:cacheprovider -q -rf > $out/x/t_state.log 2>&1
echo "pytest grid_state rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -2 $out/x/t_state.log | tee -a $log
cp cuda_ops/sampler.cu /tmp/sampler_new.cu
sed -i 's/g_n_o\[r\] = g_n\[r\] + 1;/g_n_o[r] = g_n[r] + 2;/' cuda_ops/sampler.cu
echo "planted: $(grep -c 'g_n\[r\] + 2;' cuda_ops/sampler.cu)" | tee -a $log
t0=$(date +%s)
timeout 60 python3 -m pytest tests/test_sampling_gpu.py -k "grid_state" -p no:cacheprovider -q > $out/x/t_planted.log 2>&1
echo "pytest planted rc=$? (expected 1) $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^FAILED|passed|failed" $out/x/t_planted.log | tail -3 | tee -a $log
cp /tmp/sampler_new.cu cuda_ops/sampler.cu
t0=$(date +%s)
timeout 80 python3 experiments/profile_step.py --layers 2 --steps 32 --variant nvfp4:1:sampler=temp \
  --variant nvfp4:1:sampler=reset --variant nvfp4:1:sampler=reset-grid-state \
  --out $out/profile_b1.json > $out/x/profile_b1.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
t0=$(date +%s)
timeout 90 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset reset-grid-state greedy temp reset reset-grid-state \
  --out $out/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/x/decode_b1.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset reset-grid-state temp greedy \
  --out $out/decode_b64.json > $out/x/decode_b64.log 2>&1
echo "decode b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/x/decode_b64.log | tee -a $log
for lg in flat lm; do
  t0=$(date +%s)
  timeout 50 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section InstructionStats --page source --csv --print-source sass \
    python3 experiments/bench_sampler.py --batch 64 --logits $lg --methods kernel-grid --samplers temperature_top_p \
    --steps 2 --repeats 1 --out $out/x/ncu_sampler_$lg.json > $out/x/grid64_${lg}_sass.csv 2> $out/x/ncu_$lg.err
  echo "ncu $lg rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
