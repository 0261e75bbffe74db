#!/usr/bin/env bash
# session 22 call 3: GPU tests under the new "auto" (grid for top-p), a planted bug in the grid
# kernel's climb (the test must fail), [T2-D] attention alone with the direct chain and the
# looped copy ceiling, ncu of the grid kernel at 64 rows
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_sampling_gpu.py -k "default_auto or reset_decisions or no_retrace or lowered" -p no:cacheprovider -q -rf > $out/t_auto.log 2>&1
echo "pytest auto rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_auto.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 - > $out/ceiling.log 2>&1 <<'PY'
from rejax import bench
for passes in (1, 8, 1, 8):
    print(f"copy ceiling 2 GiB passes={passes}: {bench.copy_ceiling(2 << 30, repeats=5, passes=passes) / 1e9:.0f} GB/s", flush=True)
PY
echo "ceiling rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
cat $out/ceiling.log | tee -a $log
t0=$(date +%s)
timeout 200 python3 experiments/bench_decode_long.py --attention-only --batch 1 8 \
  --out $out/attention_only.json > $out/attention_only.log 2>&1
echo "attention-only rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "attention|ceiling" $out/attention_only.log | tee -a $log
t0=$(date +%s)
timeout 150 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SpeedOfLight --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 experiments/bench_sampler.py --batch 64 --logits lm --methods kernel-grid \
  --samplers temperature_top_p --steps 2 --repeats 1 --out $out/ncu_sampler.json > $out/ncu_grid_b64.log 2>&1
echo "ncu rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
t0=$(date +%s)
# planted bug: a rejected draw no longer climbs (the row's top token instead); the test must fail
sed -i 's/best = chunk_best_above(z, lo, hi, m, it, iden, kx, xid, k0, k1, ured);/best = 0ull;/' cuda_ops/sampler.cu
grep -c "best = 0ull;" cuda_ops/sampler.cu | tee -a $log
timeout 100 python3 -m pytest tests/test_sampling_gpu.py -k "grid_variant_draws" -p no:cacheprovider -q -x > $out/t_planted.log 2>&1
echo "pytest planted rc=$? (expected 1) $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "AssertionError|assert|passed|failed" $out/t_planted.log | head -5 | tee -a $log
git checkout cuda_ops/sampler.cu 2>/dev/null || true
