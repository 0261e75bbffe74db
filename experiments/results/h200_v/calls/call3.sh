#!/usr/bin/env bash
# session 24 call 3: the grid kernel's CTAs a row at 1 and 8 rows (GRID_MIN_TOKENS 4 / 8 / 16 /
# 32 tokens a thread, ABBA order), top-p and top-k 20; the auto GPU test under the new rule;
# compute-sanitizer memcheck / racecheck on the grid kernel
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call3.log
mkdir -p $out/x
t0=$(date +%s)
timeout 100 python3 -m pytest tests/test_sampling_gpu.py -k "default_auto" -p no:cacheprovider -q -rf > $out/x/t_gpu.log 2>&1
echo "pytest rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -2 $out/x/t_gpu.log | tee -a $log
for T in 4 8 16 32 16 8 4; do
  t0=$(date +%s)
  timeout 60 python3 experiments/tmp_calls/bench_min_tokens.py $T --batch 1 8 --logits lm flat \
    --methods kernel-grid --samplers temperature_top_p reset_top_p top_k20_top_p \
    --out $out/x/mt_$T.json > $out/x/mt_$T.log 2>&1
  echo "min tokens $T rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
  grep -A5 "us over greedy" $out/x/mt_$T.log | tee -a $log
  cp $out/x/mt_$T.json $out/x/mt_${T}_$(date +%s).json
done
for tool in memcheck racecheck; do
  for s in top_k20_top_p temperature_top_p; do
    t0=$(date +%s)
    timeout 60 compute-sanitizer --tool $tool --kernel-name kns=rejax_sample --print-limit 20 \
      python3 experiments/bench_sampler.py --batch 1 8 --logits flat --methods kernel-grid \
      --samplers $s --steps 2 --repeats 1 --out $out/x/san.json > $out/x/san_${tool}_$s.log 2>&1
    echo "sanitizer $tool $s rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
    grep -E "ERROR SUMMARY|RACECHECK SUMMARY|Invalid|Race|hazard" $out/x/san_${tool}_$s.log | head -5 | tee -a $log
  done
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
