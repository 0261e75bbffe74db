#!/usr/bin/env bash
# session 19 call 2: the mma attention variant: checks, timings, GPU tests, ncu
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
t0=$(date +%s)
timeout 200 python3 experiments/bench_attention.py --impls pallas cuda \
  --cuda-variants default mma=1 mma=1,splits=32 mma=1,stages=4 mma=1,splits=32,stages=4 mma=1,warps=8,stages=2 mma=1,splits=16,warps=8 mma=1,splits=64,stages=2 \
  --pallas-variants default --slots 33280 --batch 1 8 --live 1 1024 8192 32768 \
  --steps 8 --unroll 16 --repeats 5 --check-shapes 1x33280 8x2048 3x4100 --prefill-lens --copy-mib 1024 \
  --budget-s 170 --out $out/bench_attention.json > $out/bench_attention.log 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAIL|Error|check B=|^copy ceiling" $out/bench_attention.log | head -30
sed -n '/^us per call, net/,$p' $out/bench_attention.log | head -60
t0=$(date +%s)
( timeout 230 python3 -m pytest -q --failures-now -m gpu tests/test_decode_attention_cuda_gpu.py -k "mma or impl or fori or decoder" -p no:cacheprovider > $out/t_attn.log 2>&1; echo "attn rc=$?" >> $out/t_attn.log ) &
( timeout 230 python3 -m pytest -q --failures-now -m gpu tests/test_fused_linear_gpu.py -k tiny -p no:cacheprovider > $out/t_tiny.log 2>&1; echo "tiny rc=$?" >> $out/t_tiny.log ) &
timeout 120 ncu --clock-control none -k regex:rejax_flash --launch-skip 4 --launch-count 4 \
  --section SpeedOfLight --section Occupancy --section WarpStateStats --section LaunchStats \
  python3 experiments/bench_attention.py --impls cuda --cuda-variants mma=1,splits=32 --slots 33280 --batch 1 \
  --live 8192 --steps 1 --unroll 2 --repeats 1 --no-check --prefill-lens --copy-mib 64 --out $out/ncu_bench.json > $out/ncu_full.txt 2>&1
echo "ncu rc=$?"
wait
echo "tests $(( $(date +%s) - t0 )) s"
for f in $out/t_attn.log $out/t_tiny.log; do tail -n 3 $f; grep -E "FAILED|Error" $f | head -5; done
grep -E "rejax_flash|Duration|DRAM Throughput|Registers Per|Achieved Occ|Theoretical Occ|Warp Cycles Per Issued|Block Limit" $out/ncu_full.txt | head -40
cat $out/t_attn.log $out/t_tiny.log > $out/tests.log; rm $out/t_attn.log $out/t_tiny.log $out/ncu_bench.json
