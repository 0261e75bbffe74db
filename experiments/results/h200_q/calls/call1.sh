#!/usr/bin/env bash
# session 19 call 1: attention variants, ncu of the CUDA kernel, GPU tests under "fill"
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > $out/env.txt 2>&1
python3 -c "import jax,flax;print(jax.__version__,flax.__version__)" >> $out/env.txt 2>&1
t0=$(date +%s)
timeout 230 python3 experiments/bench_attention.py --impls pallas cuda \
  --cuda-variants default prefetch=1 splits=32,prefetch=1 unroll=2,prefetch=1 warps=8,prefetch=1 splits=64 \
  --pallas-variants default warps=8 --slots 33280 --batch 1 8 --live 1 1024 8192 32768 \
  --steps 8 --unroll 16 --repeats 5 --check-shapes 1x33280 8x2048 --prefill-lens --copy-mib 1024 \
  --budget-s 200 --out $out/bench_attention.json > $out/bench_attention.log 2>&1
echo "bench rc=$? $(( $(date +%s) - t0 )) s"
grep -E "FAIL|Error|check B=|^copy ceiling|read ceiling" $out/bench_attention.log | head -30
sed -n '/^us per call, net/,$p' $out/bench_attention.log | head -60
t0=$(date +%s)
( timeout 200 python3 -m pytest -q --failures-now -m gpu tests/test_decode_attention_cuda_gpu.py -p no:cacheprovider > $out/t_attn.log 2>&1; echo "attn rc=$?" >> $out/t_attn.log ) &
( timeout 200 python3 -m pytest -q --failures-now -m gpu tests/test_gemm_gpu.py -p no:cacheprovider > $out/t_gemm.log 2>&1; echo "gemm rc=$?" >> $out/t_gemm.log ) &
( timeout 200 python3 -m pytest -q --failures-now -m gpu tests/test_fused_linear_gpu.py -k tiny -p no:cacheprovider > $out/t_tiny.log 2>&1; echo "tiny rc=$?" >> $out/t_tiny.log ) &
timeout 150 ncu --clock-control none -k regex:rejax_flash --launch-skip 0 --launch-count 40 \
  --section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section MemoryWorkloadAnalysis \
  python3 experiments/bench_attention.py --impls cuda --cuda-variants default prefetch=1 --slots 33280 --batch 1 \
  --live 1 8192 --steps 1 --unroll 2 --repeats 1 --no-check --prefill-lens --copy-mib 64 --out $out/ncu_bench.json > $out/ncu_full.txt 2>&1
echo "ncu rc=$?"
grep -E "rejax_flash|Duration|DRAM Throughput|Memory Throughput|Registers|Achieved Occ|Theoretical Occ|Grid Size|Block Size|Stall|Warp Cycles" $out/ncu_full.txt | head -150 > $out/ncu.txt
wait
echo "tests $(( $(date +%s) - t0 )) s"
tail -4 $out/t_attn.log $out/t_gemm.log $out/t_tiny.log
