#!/usr/bin/env bash
# One device session for the end-to-end runs: activation quantization GPU-vs-CPU check, the
# Qwen3-8B decode benchmark and the tiny-reasoner accuracy experiment.
# Usage: experiments/e2e_device_run.sh OUTDIR [phases]
#   (phases: env quant pytest decode2 decode accuracy)
# Extra arguments per phase: DECODE_ARGS, ACC_ARGS; time limits: DECODE_TIMEOUT, ACC_TIMEOUT.
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env quant decode}
export PYTHONPATH=. PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  echo "[phase $phase starts $(date -u +%H:%M:%S)]"
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
      } > "$out/env.txt" 2>&1; cat "$out/env.txt";;
    quant)
      timeout 120 python3 experiments/gpu_quant_check.py --out "$out/gpu_quant_check.json" \
        > "$out/gpu_quant_check.log" 2>&1; tail -30 "$out/gpu_quant_check.log";;
    pytest)  # the gpu-marked kernel tests
      timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
        > "$out/pytest_gpu.log" 2>&1; echo "rc=$?"; tail -8 "$out/pytest_gpu.log";;
    decode2)  # compile-time check on 2 layers of the real widths before the full run
      timeout 150 python3 experiments/bench_decode.py --layers 2 --modes nvfp4 --batch 1 \
        --gen-len 64 --no-breakdown --out "$out/bench_decode_2layer.json" 2>&1 | tail -8;;
    decode)
      timeout ${DECODE_TIMEOUT:-480} python3 experiments/bench_decode.py ${DECODE_ARGS:-} \
        --out "$out/bench_decode_h200.json" > "$out/bench_decode_h200.log" 2>&1
      echo "rc=$?"; grep -v "^\s*$" "$out/bench_decode_h200.log" | tail -40;;
    accuracy)
      timeout ${ACC_TIMEOUT:-480} python3 experiments/tiny_reasoner_accuracy.py ${ACC_ARGS:-} \
        --out-prefix "$out/tiny_reasoner_accuracy" > "$out/tiny_reasoner_accuracy.log" 2>&1
      echo "rc=$?"; tail -40 "$out/tiny_reasoner_accuracy.log";;
  esac
  echo "[phase $phase took $(( $(date +%s) - t0 )) s]"
done
