#!/usr/bin/env bash
# session 19 call 3: attention GPU tests (mma cases), ncu of the mma attention at b1, ncu source view of the GEMM (fill, M=64)
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
t0=$(date +%s)
( timeout 280 python3 -m pytest -q -rA --failures-now -m gpu tests/test_decode_attention_cuda_gpu.py -p no:cacheprovider > $out/t_attn.log 2>&1; echo "attn rc=$?" >> $out/t_attn.log ) &
for live in 8192 1 32768; do
  for v in mma=1,splits=16,warps=8 default; do
    timeout 70 ncu --clock-control none -k regex:rejax_flash --launch-count 3 \
      --section SpeedOfLight --section WarpStateStats --section Occupancy \
      python3 experiments/bench_attention.py --impls cuda --cuda-variants $v --slots 33280 --batch 1 \
      --live $live --steps 1 --unroll 4 --repeats 2 --no-check --prefill-lens --copy-mib 64 --out /tmp/nb.json > /tmp/ncu_${live}_${v}.txt 2>&1
    echo "== live=$live $v rc=$?"
    grep -E "Duration|DRAM Throughput|Warp Cycles Per Issued|Achieved Occ" /tmp/ncu_${live}_${v}.txt | head -8
  done
done > $out/ncu_attn.txt 2>&1
cat $out/ncu_attn.txt
timeout 200 ncu --clock-control none -k regex:nvfp4_gemm --launch-count 2 \
  --section SpeedOfLight --section WarpStateStats --section SourceCounters --section InstructionStats --section SchedulerStats \
  python3 experiments/bench_gemm.py --ms 64 --shapes 24576:4096 --ops gemm_graph --variants gemm --out /tmp/gb.json > $out/ncu_gemm_src.txt 2>&1
echo "gemm ncu rc=$?"
grep -E "nvfp4_gemm|Duration|Stall|Warp Cycles|Issue Slots|Eligible" $out/ncu_gemm_src.txt | head -60
wait
echo "all $(( $(date +%s) - t0 )) s"
grep -E "PASSED|FAILED|passed|failed|rc=" $out/t_attn.log | tail -25
