#!/usr/bin/env bash
# The GPU check and timings of the lean batch-1 GEMV (experiments/kernels/gemv_lean.py: the prmt
# tables read from memory, one address per row group) against production: "new" is a copy of
# the tree with gemv_lean.py --write-tree's cuda_ops files, "base" is this tree.
#
#   bash experiments/kernels/gemv_lean_run.sh OUT STEP...    (from the repository root)
#
# STEP (in the order given):
#   tests   in the lean tree, the GPU tests of every kernel that includes common.cuh (GEMV,
#           fused linears, the quantizer, the decode attention's quantized output): they pin the
#           bits
#   kernel  bench_kernel.py on the four Qwen3-8B shapes at M = 1, 2, 4, 8 (our W4A4 GEMV in CUDA
#           graphs, the read floor), base then new, alternated twice (ABAB);
#           OUT/gemv_lean_kernel.json: per shape and M the median ratio new / base
#   decode  bench_decode.py, 36-layer Qwen3-8B NVFP4, batch 1 and 8, 512 new tokens, the two
#           trees alternated twice; OUT/gemv_lean_decode.json: ms/token and the ratio
# OUT gets the summaries and gemv_lean_raw.tgz (every run's JSON and log). GIT_SHA names the
# commit in the JSONs. KERNEL_MS, KERNEL_SHAPES, DECODE_BATCH override.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests kernel decode)" >&2
  exit 2
fi
out=$(realpath -m "$1")
shift
mkdir -p "$out/raw"
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
sha=${GIT_SHA:-unknown}
lean=/tmp/gemv_lean_tree
make_lean() {  # a copy of the tree with the lean cuda_ops files
  [ -d "$lean" ] && return 0
  mkdir -p "$lean" && cp -r cuda_ops rejax experiments tests pyproject.toml "$lean"/ &&
    python3 experiments/kernels/gemv_lean.py --write-tree "$lean"
}
for step in "$@"; do
  t0=$(date +%s)
  case $step in
    tests)
      make_lean || { echo "no lean tree"; continue; }
      (cd "$lean" && timeout ${TESTS_TIMEOUT:-300} python3 -m pytest -q -m gpu -rs -p no:cacheprovider \
        tests/test_kernels_gpu.py tests/test_fused_linear_gpu.py tests/test_quant_kernel_gpu.py \
        tests/test_decode_attention_cuda_gpu.py > "$out/gemv_lean_tests.log" 2>&1)
      echo "tests rc=$?"; tail -6 "$out/gemv_lean_tests.log";;
    kernel)
      make_lean || { echo "no lean tree"; continue; }
      for run in 1 2; do
        for tree in base new; do
          dir=.; [ $tree = new ] && dir=$lean
          (cd "$dir" && PYTHONPATH=. timeout ${KERNEL_TIMEOUT:-150} python3 experiments/bench_kernel.py \
            --ms ${KERNEL_MS:-1,2,4,8} --shapes ${KERNEL_SHAPES:-6144:4096,4096:4096,24576:4096,4096:12288} \
            --ops nvfp4_w4a4_graph,read_floor_graph --no-chain \
            --out "$out/raw/gemv_lean_kernel_${tree}_$run.json" > "$out/raw/gemv_lean_kernel_${tree}_$run.log" 2>&1)
          echo "kernel $tree $run rc=$?"
        done
      done
      python3 experiments/kernels/gemv_lean.py --summarize-kernel "$out" --git-sha "$sha" \
        --json-out "$out/gemv_lean_kernel.json";;
    decode)
      make_lean || { echo "no lean tree"; continue; }
      for run in 1 2; do
        for tree in base new; do
          dir=.; [ $tree = new ] && dir=$lean
          (cd "$dir" && PYTHONPATH=. timeout ${DECODE_TIMEOUT:-200} python3 experiments/bench_decode.py \
            --modes nvfp4 --batch ${DECODE_BATCH:-1 8} --gen-len 512 --repeats 3 --no-breakdown \
            --out "$out/raw/gemv_lean_decode_${tree}_$run.json" > "$out/raw/gemv_lean_decode_${tree}_$run.log" 2>&1)
          echo "decode $tree $run rc=$?"
        done
      done
      python3 experiments/kernels/gemv_lean.py --summarize-decode "$out" --git-sha "$sha" \
        --json-out "$out/gemv_lean_decode.json";;
    *) echo "unknown step $step";;
  esac
  echo "[$step: $(( $(date +%s) - t0 )) s]"
done
# the per-run JSONs and logs as one file (the device returns few files)
tar czf "$out/gemv_lean_raw.tgz" -C "$out" raw && rm -rf "$out/raw"
