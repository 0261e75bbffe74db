#!/usr/bin/env bash
# Device phases for the stacked / fused decoder ([T2-A]) and its comparisons on the H200.
# Usage: experiments/decode_device_run.sh OUTDIR [phases]
#   env      versions and GPU
#   gputest  the gpu-marked tests (tests/test_kernels_gpu.py)
#   hlo      optimized-HLO report of the decode step (2 and 36 layers, bf16 and NVFP4)
#   ab8      8-layer decode, this tree vs the baseline tree in .base/ (BASE), same GPU, one call
#   abflags  this tree with XLA_FLAGS variants FLAGS_A / FLAGS_B (e.g. dynamic-slice fusion)
#   cold36   36-layer NVFP4 batch 1: first-call (compile + run) times with an empty JAX cache,
#            then again in a second process from the persistent cache
# Extra arguments: AB_ARGS (bench_decode.py for ab8), BASE (baseline tree, default .base).
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env gputest hlo ab8 cold36}
export PYTHONPATH=. PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
base=${BASE:-.base}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  echo "[phase $phase starts $(date -u +%H:%M:%S)]"
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
      } > "$out/env.txt" 2>&1; cat "$out/env.txt";;
    gputest)
      timeout ${GPUTEST_TIMEOUT:-300} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py -x \
        > "$out/gpu_tests.log" 2>&1; echo "rc=$?"; tail -15 "$out/gpu_tests.log";;
    hlo)
      timeout ${HLO_TIMEOUT:-200} python3 experiments/hlo_report.py --layers 2 36 \
        --out "$out/hlo_report.json" > "$out/hlo_report.log" 2>&1; echo "rc=$?"
      grep "^\[" "$out/hlo_report.log"; grep -v "^\[" "$out/hlo_report.log" | head -30;;
    ab8)
      args=${AB_ARGS:---layers 8 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      ( cd "$base" && JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_base timeout ${AB_TIMEOUT:-240} \
          python3 experiments/bench_decode.py $args --out "$out/ab8_base.json" \
          > "$out/ab8_base.log" 2>&1; echo "base rc=$?" )
      grep "^\[" "$out/ab8_base.log"
      JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${AB_TIMEOUT:-240} \
        python3 experiments/bench_decode.py $args --out "$out/ab8_new.json" \
        > "$out/ab8_new.log" 2>&1; echo "new rc=$?"; grep "^\[" "$out/ab8_new.log";;
    abflags)  # this tree only, with per-run XLA flags (FLAGS_A, FLAGS_B), same args as ab8
      args=${AB_ARGS:---layers 8 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      for tag in A B; do
        var=FLAGS_$tag; flags=${!var:-}
        [ -n "$flags" ] || continue
        XLA_FLAGS="$flags" JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$tag timeout ${AB_TIMEOUT:-240} \
          python3 experiments/bench_decode.py $args ${FLAG_ARGS:-} --out "$out/ab8_flags$tag.json" \
          > "$out/ab8_flags$tag.log" 2>&1; echo "flags $tag ($flags) rc=$?"
        grep "^\[" "$out/ab8_flags$tag.log"
      done;;
    cold36)
      rm -rf /tmp/jaxcache36
      for run in cold warm; do
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache36 timeout ${COLD_TIMEOUT:-200} \
          python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 1024 \
          --repeats 3 --no-breakdown ${COLD_ARGS:-} --out "$out/cold36_$run.json" \
          > "$out/cold36_$run.log" 2>&1; echo "$run rc=$?"
        grep "compiled\|^\[" "$out/cold36_$run.log"
      done;;
  esac
  echo "[phase $phase took $(( $(date +%s) - t0 )) s]"
done
