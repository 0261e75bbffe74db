#!/usr/bin/env bash
# [T2-L] on the H200: per-row live decode attention and row-count invariance of the decode step.
# Usage: experiments/invariance_device_run.sh OUT [phases]; phases (default: tests rowinv slots):
#   tests   GPU tests of TEST_FILES (default tests/test_decode_attention.py) selected by
#           PYTEST_K (default per_row: the per-row live attention tests); e.g.
#           TEST_FILES="tests/test_decode_attention.py tests/test_slots.py" PYTEST_K=gpu
#   rowinv  experiments/row_invariance_check.py: one decode step at 64 rows against 32 and 16
#           gathered rows, bf16 and NVFP4, "live" attention, prompts of ROWINV_PROMPT (1024)
#   slots   experiments/bench_slots.py: 512 rows through 64 slots against static batches, 1
#           layer, greedy, NVFP4 and bf16, default compaction ("auto"), SLOTS_BUDGET s each
#   flags   bench_slots.py bf16, static batches against "auto" compaction only, full length
#           (scale 1.0), once per XLA flag set in FLAG_SETS (";"-separated; "none" = no
#           flags), each in its own process: OUT/flags_<i>.json and .log
#   speed1  bench_decode.py 1 layer, NVFP4 and bf16, batch 64, a 2112-slot cache, with
#           Config.xla_autotune off and on in one process (the twelfth session saw NVFP4
#           static batches 6.5x slower with it off at 1 layer): OUT/speed1.json and .log
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-tests rowinv slots}
export PYTHONPATH=. PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  case $phase in
    tests)
      # shellcheck disable=SC2086
      timeout "${TESTS_TIMEOUT:-150}" python3 -m pytest -m gpu ${TEST_FILES:-tests/test_decode_attention.py} \
        -k "${PYTEST_K:-per_row}" -v --tb=short -rfE -p no:cacheprovider > "$out/gpu_tests.log" 2>&1
      echo "pytest exit $?"; grep -E " PASSED| FAILED|^E  " "$out/gpu_tests.log" | cut -c1-200 | head -20;;
    rowinv)
      timeout "${ROWINV_TIMEOUT:-150}" python3 experiments/row_invariance_check.py \
        --quant bf16 nvfp4 --attention live --barrier on --prompt-len "${ROWINV_PROMPT:-1024}" \
        --out "$out/rowinv.json" > "$out/rowinv.log" 2>&1
      echo "rowinv exit $?"; grep -E "\] C=|FAILED" "$out/rowinv.log";;
    slots)
      timeout "${SLOTS_TIMEOUT:-400}" python3 experiments/bench_slots.py --layers 1 \
        --sampler greedy --quant nvfp4 bf16 --prompt-len 33 64 \
        --time-budget "${SLOTS_BUDGET:-160}" --out "$out/bench_slots.json" > "$out/slots.log" 2>&1
      echo "bench_slots exit $?"; grep -vi "warning" "$out/slots.log" | tail -30;;
    flags)
      i=0
      IFS=';' read -ra sets <<< "${FLAG_SETS:-none;--xla_gpu_autotune_level=0;--xla_allow_excess_precision=false}"
      for fs in "${sets[@]}"; do
        [ "$fs" = none ] && fs=""
        t1=$(date +%s)
        XLA_FLAGS="$fs" timeout "${FLAGS_TIMEOUT:-170}" python3 experiments/bench_slots.py \
          --layers 1 --sampler greedy --quant bf16 --prompt-len 33 64 --paths compact \
          --out "$out/flags_$i.json" > "$out/flags_$i.log" 2>&1
        echo "flags [$fs] exit $? in $(( $(date +%s) - t1 )) s"
        grep -E "compact:|static batches|compiled" "$out/flags_$i.log" | cut -c1-400
        i=$((i + 1))
      done;;
    speed1)
      timeout "${SPEED1_TIMEOUT:-240}" python3 experiments/bench_decode.py --layers 1 \
        --modes nvfp4 bf16 --batch 64 --xla-autotune off on --no-breakdown --gen-len 2048 \
        --prompt-len 64 --repeats 2 --out "$out/speed1.json" > "$out/speed1.log" 2>&1
      echo "speed1 exit $?"; grep -E "ms/token|first calls" "$out/speed1.log" | cut -c1-200;;
    *) echo "unknown phase $phase";;
  esac
  echo "[phase $phase: $(( $(date +%s) - t0 )) s]"
done
