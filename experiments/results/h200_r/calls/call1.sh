#!/usr/bin/env bash
# session 20 call 1: the "reject" sampler variant (GPU tests, kernel alone, 36-layer loop);
# the GEMM with KT 256
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > $log 2>&1
t0=$(date +%s)
timeout 200 python3 -m pytest -m gpu tests/test_sampling_gpu.py -k reject -v --tb=short -rfE \
  --durations=5 -p no:cacheprovider > $out/gpu_tests.log 2>&1
echo "pytest rc=$? passed $(grep -c ' PASSED' $out/gpu_tests.log) failed $(grep -c ' FAILED' $out/gpu_tests.log) $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^(FAILED|ERROR)|^E  " $out/gpu_tests.log | cut -c1-300 | head -20
t0=$(date +%s)
timeout 220 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset reset-reject temp temp-reject topk20 \
  --out $out/decode_samplers.json >> $log 2>&1
echo "decode rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $log | tail -14
for b in 1 64; do
  t0=$(date +%s)
  timeout 60 python3 experiments/bench_sampler.py --batch $b --logits flat --methods kernel \
    --variants split merge cluster reject --stats two_pass \
    --samplers temperature_top_p top_k20 reset_top_p --out $out/bench_sampler_b$b.json >> $log 2>&1
  echo "bench_sampler b$b rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
done
t0=$(date +%s)
timeout 110 python3 experiments/bench_gemm.py --ms 16,32,64 --shapes 4096:4096,6144:4096,24576:4096,4096:12288 \
  --variants gemm,gemm_kt256 --ops gemm_graph,jax_bf16 --time-budget 90 --out $out/bench_gemm_kt256.json >> $log 2>&1
echo "bench_gemm rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -30 $log
