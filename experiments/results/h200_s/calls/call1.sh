#!/usr/bin/env bash
# session 21 call 1 ([T2-E]/[T2-B]): the decode loop sampling at the end of its body, one and
# eight steps per predicate check (Config.decode_unroll); samplers in the 36-layer loop at
# batch 1 / 64; the previous commit (c062d3c) at batch 1 in the same call; a kernel timeline;
# GPU runs of the loop's tests
set -uo pipefail
out=$1
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call1.log
{ nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
  python3 -c "import jax; print('jax', jax.__version__, jax.devices())"; } > $log 2>&1
t0=$(date +%s)
PYTHONPATH=. timeout 250 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset reset-reject temp temp-reject topk20 --decode-unroll 1 8 \
  --out $out/decode_samplers.json > $out/decode_new.log 2>&1
echo "decode new rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_new.log | tee -a $log
t0=$(date +%s)
(cd experiments/tmp_calls/base && PYTHONPATH=. timeout 80 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy reset temp-reject \
  --out $out/decode_samplers_base.json > $out/decode_base.log 2>&1)
echo "decode base rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_base.log | tee -a $log
t0=$(date +%s)
PYTHONPATH=. timeout 70 python3 experiments/profile_step.py --layers 36 --steps 16 --variant nvfp4:1 \
  --variant nvfp4:1:sampler=temp --variant nvfp4:1:sampler=temp-reject --variant nvfp4:1:decode_unroll=8 \
  --variant nvfp4:1:sampler=temp-reject:decode_unroll=8 \
  --out $out/profile_samplers.json > $out/profile_samplers.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^\[|idle" $out/profile_samplers.log | cut -c1-160 | tee -a $log
t0=$(date +%s)
PYTHONPATH=. timeout 150 python3 -m pytest tests/test_generate.py tests/test_kernels_gpu.py -k "not xla_launch and not kernel_matches" \
  -v --tb=short -rfE -p no:cacheprovider > $out/t_loop.log 2>&1
echo "pytest rc=$? passed $(grep -c ' PASSED' $out/t_loop.log) failed $(grep -c ' FAILED' $out/t_loop.log) $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "^(FAILED|ERROR)|^E  " $out/t_loop.log | cut -c1-300 | head -20
