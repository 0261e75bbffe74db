#!/usr/bin/env bash
# session 19 call 5: launch sweep of the mma attention; ncu stall reasons at b1 8K
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
timeout 150 python3 experiments/bench_attention.py --impls pallas cuda --pallas-variants default \
  --cuda-variants mma=1,splits=16,warps=8 mma=1,splits=16,warps=4,stages=4 mma=1,splits=16,warps=6 mma=1,splits=12,warps=8 mma=1,splits=20,warps=8 mma=1,splits=16,warps=8,stages=2 mma=1,splits=32,warps=4,stages=2 \
  --slots 33280 --batch 1 8 --live 1 1024 8192 32768 --steps 8 --unroll 16 --repeats 5 --check-shapes 1x33280 3x4100 \
  --prefill-lens --copy-mib 1024 --budget-s 130 --out $out/bench_attention_sweep.json > $out/bench_sweep.log 2>&1
echo "bench rc=$?"; grep -E "FAIL|check B=" $out/bench_sweep.log; sed -n '/^us per call, net/,$p' $out/bench_sweep.log | head -20
timeout 90 ncu --clock-control none -k regex:rejax_flash --launch-count 2 --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --print-details all \
  python3 experiments/bench_attention.py --impls cuda --cuda-variants mma=1,splits=16,warps=8 --slots 33280 --batch 1 \
  --live 8192 --steps 1 --unroll 4 --repeats 2 --no-check --prefill-lens --copy-mib 64 --out /tmp/nb.json > $out/ncu_mma_8k.txt 2>&1
echo "ncu rc=$?"; grep -iE "stall|Duration|Eligible|Throughput" $out/ncu_mma_8k.txt | head -40
