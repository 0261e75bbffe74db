#!/usr/bin/env bash
# The GPU check and timings of the TMA-streamed batch-1 GEMV (experiments/kernels/
# nvfp4_gemv_tma.cu; [T2-B]: production's M = 1 GEMV runs at the read floor of its own
# occupancy, KERNEL_NOTES log 16).
#
#   bash experiments/kernels/gemv_tma_run.sh OUT STEP...    (from the repository root)
#
# STEP (run in the order given; "check sanitize" fits one 600 s device call with a cold start):
#   check     check_gemv_tma.py on the four Qwen3-8B shapes, every variant: bytes against float64
#             and production, then each alone in CUDA graphs against production's GEMV and the
#             read floor (about 2 minutes)
#   sanitize  compute-sanitizer memcheck and racecheck of three variants (TMA, 8 rows a stage, the
#             cp.async producer) on two small shapes, correctness only
#   decode    the 36-layer Qwen3-8B NVFP4 decode loop at batch 1 (512 new tokens, 3 repeats),
#             production's GEMVs against the TMA kernel's (bench_decode.py --gemv-tma
#             $TMA_SPEC, default "default"), one process each, alternated twice (ABAB); its own
#             call (about 4 x 100 s)
#   kernel    bench_kernel.py at M = 1 on all the paper's layer shapes, production's GEMV, then
#             the TMA kernel (--gemv-tma $TMA_SPEC): jitted and CUDA-graph times, the read floor,
#             jitted bf16 (the [T2-B] kernel table); its own call (about 2 x 250 s)
#   block     check_block_tma.py: the one-launch post-attention block (nvfp4_block_tma.cu: o +
#             residual, RMSNorm + quantization, gate_up + SwiGLU, down + residual, at batch 1)
#             and the one-launch pre-attention kernel (input RMSNorm + quantization, qkv,
#             rope_cache's work) byte for byte against the kernels they fuse, then timed against
#             production's launches and the TMA GEMVs', Qwen3-8B (about 3 minutes)
#   block_sanitize  compute-sanitizer memcheck and racecheck of the block kernels (TMA and
#             cp.async producers, o's input as codes and in bf16; the pre-attention kernel) on
#             small shapes, correctness only
#   block_decode  as decode, production against the block kernel (bench_decode.py --block-tma
#             $BLOCK_SPEC, default "default"; with QKV_SPEC set also --qkv-tma $QKV_SPEC, the
#             pre-attention kernel); its own call (about 4 x 100 s)
# GIT_SHA names the commit in the JSON (the device copy's .git may hold an older one). OUT gets
# the summary log (gemv_tma.log), check's JSON and one tarball of the step logs.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: check sanitize decode kernel block block_sanitize" \
    "block_decode)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in check | sanitize | decode | kernel | block | block_sanitize | block_decode) ;; *)
    echo "unknown step '$step': expected check, sanitize, decode, kernel, block," \
      "block_sanitize or block_decode" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
x=$out/x
mkdir -p "$out" "$x"
log=$out/gemv_tma.log
check=experiments/kernels/check_gemv_tma.py
sha=${GIT_SHA:-$(git rev-parse HEAD)}
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  check)
    timeout 300 python3 $check --git-sha "$sha" --out "$out/gemv_tma.json" > "$x/check.log" 2>&1
    stamp check $? $t0
    tail -45 "$x/check.log" | tee -a "$log"
    ;;
  sanitize)
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      timeout 150 compute-sanitizer --tool $tool --kernel-name kns=nvfp4_gemv_tma \
        --print-limit 20 python3 $check --no-time --variants tma,tma_w8_s12,lsu \
        --shapes 1024x2048,512x4096 --out "$x/sanitize_$tool.json" > "$x/sanitize_$tool.log" 2>&1
      stamp "sanitize $tool" $? $t0
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|failures" "$x/sanitize_$tool.log" \
        | head -6 | tee -a "$log"
    done
    ;;
  decode | block_decode)
    runs="prod tma prod tma"
    [ $step = block_decode ] && runs="prod block prod block"
    for run in $runs; do
      t0=$(date +%s)
      extra=()
      [ $run = tma ] && extra=(--gemv-tma "${TMA_SPEC:-default}")
      [ $run = block ] && extra=(--block-tma "${BLOCK_SPEC:-default}")
      [ $run = block ] && [ -n "${QKV_SPEC:-}" ] && extra+=(--qkv-tma "$QKV_SPEC")
      timeout 150 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 512 \
        --repeats 3 --no-breakdown "${extra[@]}" --out "$x/decode_${run}_$t0.json" \
        > "$x/decode_${run}_$t0.log" 2>&1
      stamp "decode $run" $? $t0
      grep -E "ms/token|rror" "$x/decode_${run}_$t0.log" | tail -3 | tee -a "$log"
    done
    ;;
  kernel)
    for run in prod tma; do
      t0=$(date +%s)
      extra=()
      [ $run = tma ] && extra=(--gemv-tma "${TMA_SPEC:-default}")
      timeout 280 python3 experiments/bench_kernel.py --ms 1 --no-chain \
        --ops nvfp4_w4a4,nvfp4_w4a4_graph,read_floor_graph,jax_bf16 "${extra[@]}" \
        --out "$out/bench_kernel_m1_$run.json" > "$x/kernel_$run.log" 2>&1
      stamp "kernel $run" $? $t0
      tail -12 "$x/kernel_$run.log" | tee -a "$log"
    done
    ;;
  block)
    timeout 420 python3 experiments/kernels/check_block_tma.py --git-sha "$sha" \
      --out "$out/block_tma.json" > "$x/block.log" 2>&1
    stamp block $? $t0
    tail -45 "$x/block.log" | tee -a "$log"
    ;;
  block_sanitize)
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      timeout 200 compute-sanitizer --tool $tool --kernel-name kns=_tma \
        --print-limit 20 python3 experiments/kernels/check_block_tma.py --no-time \
        --variants tma,lsu,tma_a16 --shape 1024x1024x1536 --qkv-variants tma,lsu \
        --qkv-shape 1024x8x2x128x64 \
        --out "$x/block_sanitize_$tool.json" > "$x/block_sanitize_$tool.log" 2>&1
      stamp "block_sanitize $tool" $? $t0
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard|failures" "$x/block_sanitize_$tool.log" \
        | head -6 | tee -a "$log"
    done
    ;;
  esac
done
tar -czf "$out/gemv_tma_$(echo "$@" | tr ' ' _).tgz" -C "$x" . && rm -rf "$x"
