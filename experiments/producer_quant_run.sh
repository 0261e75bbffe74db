#!/usr/bin/env bash
# The GPU checks and timings of the kernels that write a linear's NVFP4 input themselves
# ([T2-B]: fewer launches a decoder layer): Config(attention_output="nvfp4") (the one-launch
# CUDA decode attention writes o_proj's input), Config(gate_up_output="nvfp4") (the gate_up
# GEMV's SwiGLU epilogue writes down_proj's input) and Config(o_proj_output="nvfp4") (o_proj's
# residual GEMV, NORM_OUT, writes gate_up's input). Under attention "flash-mma" with all three,
# a layer launches 7 kernels instead of 10 ("live", the default: 11).
#
#   bash experiments/producer_quant_run.sh OUT STEP...    (from the repository root)
#
# STEP (run in the order given; each fits one 600 s device call with a cold start):
#   tests     the QUANT_OUT attention's bytes against quantize_activation of the bf16 build's
#             output; the SWIGLU_OUT and NORM_OUT GEMVs' bytes against the split path's
#             quantizer; the
#             decoder's logits with each "nvfp4" output == "bf16" bitwise; "flash" /
#             "flash-mma" against "live" (test_decode_attention_cuda_gpu.py,
#             test_fused_linear_gpu.py)
#   sanitize  compute-sanitizer memcheck and racecheck of the three kernels (their tests'
#             small cases), the six runs at once (one after another they take about 6 x 130 s,
#             more than a device call)
#   decode    the 36-layer decode loop at batch 1 and 8, 1024 new tokens, 3 repeats, one
#             process, the same weights, bf16 and NVFP4: attention "live" and "flash-mma" with
#             attention_output "nvfp4", each with gate_up_output x o_proj_output in bf16 /
#             nvfp4 (under "live" neither attention_output nor o_proj_output applies: those
#             pairs are A/A, the run's noise) (bench_decode.py)
#   accept    [T2-B]'s acceptance run with today's defaults: the 36-layer decode loop at batch 1,
#             1024 new tokens, 3 repeats, bf16 and NVFP4 in one process with the breakdown and
#             the copy ceiling (bench_decode.py), then the kernels a layer launches
#             (count_kernels.py, 4 layers, batch 1 and 8)
#   pdl       experiments/pdl_probe.py: what programmatic dependent launch would hide per GEMV
#             launch (a CUDA graph of 36 layers x 4 GEMVs, about a minute); GIT_SHA names the
#             commit in its JSON (the device copy's .git may hold the session's first commit)
# OUT gets the summary log (producer_quant.log) and one tarball of every step's logs and JSON
# (producer_quant_STEPS.tgz; a device call brings back at most 8 files).
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests sanitize decode accept pdl)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | sanitize | decode | accept | pdl) ;; *)
    echo "unknown step '$step': expected tests, sanitize, decode, accept or pdl" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
x=$out/x  # every step's files; tarred at the end
mkdir -p "$out" "$x"
log=$out/producer_quant.log
attn=tests/test_decode_attention_cuda_gpu.py
lin=tests/test_fused_linear_gpu.py
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  tests)
    timeout 480 python3 -m pytest $attn $lin \
      -k "nvfp4 or decoder_flash or swiglu_epilogue or norm_out" \
      -p no:cacheprovider -q -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  sanitize)
    pids=()
    names=()
    for tool in memcheck racecheck; do
      for pair in "rejax_flash_decode:$attn:nvfp4_output and 2-600" \
        "nvfp4_gemv_w4a4:$lin:swiglu_epilogue and 512-768" \
        "nvfp4_gemv_w4a4:$lin:norm_out_tail and 1024-512"; do
        IFS=: read -r kern file sel <<< "$pair"
        name=sanitize_${tool}_${kern}_$(echo "$sel" | awk '{print $1}')
        timeout 300 compute-sanitizer --tool $tool --kernel-name kns=$kern --print-limit 20 \
          python3 -m pytest $file -p no:cacheprovider -q -k "$sel" > "$x/$name.log" 2>&1 &
        pids+=($!)
        names+=("$name")
      done
    done
    for i in "${!pids[@]}"; do
      wait "${pids[$i]}"
      stamp "${names[$i]}" $? $t0
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|passed|failed" "$x/${names[$i]}.log" \
        | head -6 | tee -a "$log"
    done
    ;;
  decode)
    timeout 560 python3 experiments/bench_decode.py --modes nvfp4 bf16 --batch 1 8 \
      --gen-len 1024 --repeats 3 --no-breakdown --attention live flash-mma \
      --attention-output nvfp4 --gate-up-output bf16 nvfp4 --o-proj-output bf16 nvfp4 \
      --out "$x/decode.json" > "$x/decode.log" 2>&1
    stamp decode $? $t0
    grep -E "ms/token|Error|error" "$x/decode.log" | tail -20 | tee -a "$log"
    ;;
  accept)
    timeout 420 python3 experiments/bench_decode.py --modes bf16 nvfp4 --batch 1 \
      --gen-len 1024 --repeats 3 --out "$x/accept.json" > "$x/accept.log" 2>&1
    stamp accept $? $t0
    grep -E "ms/token|Error|error" "$x/accept.log" | tail -20 | tee -a "$log"
    t0=$(date +%s)
    timeout 150 python3 experiments/count_kernels.py --layers 4 --batch 1 8 \
      --out "$x/count_kernels.json" > "$x/count_kernels.log" 2>&1
    stamp count $? $t0
    tail -12 "$x/count_kernels.log" | tee -a "$log"
    ;;
  pdl)
    timeout 300 python3 experiments/pdl_probe.py --git-sha "${GIT_SHA:-$(git rev-parse HEAD)}" \
      --out "$x/pdl_probe.json" > "$x/pdl_probe.log" 2>&1
    stamp pdl $? $t0
    tail -6 "$x/pdl_probe.log" | tee -a "$log"
    ;;
  esac
done
tar -czf "$out/producer_quant_$(echo "$@" | tr ' ' _).tgz" -C "$x" . && rm -rf "$x"
