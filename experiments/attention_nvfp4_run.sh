#!/usr/bin/env bash
# The GPU checks and timings of Config(attention_output="nvfp4") ([T2-B]: the one-launch CUDA
# decode attention writes o_proj's NVFP4 input, so a layer launches 9 kernels instead of 10
# under "flash" / "flash-mma"), and of "flash-mma" itself against "live".
#
#   bash experiments/attention_nvfp4_run.sh OUT STEP...    (from the repository root)
#
# STEP (run in the order given; each fits one 600 s device call with a cold start):
#   tests     the QUANT_OUT kernel's bytes against quantize_activation of the bf16 build's
#             output, the decoder's logits "nvfp4" == "bf16" bitwise, and the decoder under
#             "flash" / "flash-mma" against "live" (test_decode_attention_cuda_gpu.py)
#   sanitize  compute-sanitizer memcheck and racecheck of the QUANT_OUT kernel (the test's
#             H = 16 and Qwen3-8B cases)
#   decode    the 36-layer NVFP4 decode loop at batch 1 and 8, 1024 new tokens, 3 repeats:
#             attention "live" and "flash-mma", each with attention_output "bf16" then
#             "nvfp4" (live's "nvfp4" does not apply: an A/A pair, the run's noise), one
#             process, the same weights (bench_decode.py)
# OUT gets the summary log (attention_nvfp4.log) and one tarball of every step's logs and JSON
# (attention_nvfp4_STEPS.tgz; a device call brings back at most 8 files).
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests sanitize decode)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | sanitize | decode) ;; *)
    echo "unknown step '$step': expected tests, sanitize or decode" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
x=$out/x  # every step's files; tarred at the end
mkdir -p "$out" "$x"
log=$out/attention_nvfp4.log
gpu_tests=tests/test_decode_attention_cuda_gpu.py
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  tests)
    timeout 420 python3 -m pytest $gpu_tests -k "nvfp4 or decoder_flash" -p no:cacheprovider \
      -q -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  sanitize)
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      timeout 200 compute-sanitizer --tool $tool --kernel-name kns=rejax_flash_decode \
        --print-limit 20 python3 -m pytest $gpu_tests -p no:cacheprovider -q \
        -k "nvfp4_output and (600 or 1536)" > "$x/sanitize_$tool.log" 2>&1
      stamp "sanitize $tool" $? $t0
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$x/sanitize_$tool.log" \
        | head -6 | tee -a "$log"
    done
    ;;
  decode)
    timeout 540 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 8 --gen-len 1024 \
      --repeats 3 --no-breakdown --attention live flash-mma \
      --attention-output bf16 nvfp4 --out "$x/decode.json" > "$x/decode.log" 2>&1
    stamp decode $? $t0
    grep -E "ms/token|Error|error" "$x/decode.log" | tail -20 | tee -a "$log"
    ;;
  esac
done
tar -czf "$out/attention_nvfp4_$(echo "$@" | tr ' ' _).tgz" -C "$x" . && rm -rf "$x"
