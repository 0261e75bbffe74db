#!/usr/bin/env bash
# The GPU checks and timings of sampler_grid_barrier.patch ([T2-E], 1 row): the grid sampler's
# barriers arriving with release semantics, no sequentially consistent fence (BAR_ARRIVE=1,
# the patch's default; 2: a release reduction), against the tree's source.
#
#   bash experiments/kernels/barrier_patch_run.sh OUT STEP...    (from the repository root)
#
# STEP (in the order given; logs, JSON and dumps under OUT):
#   same    sampler_draws_dump.py on the tree, on the patch and on the patch with BAR_ARRIVE=2
#           for "cdf": every token, entropy, temperature and ReSET state bit for bit the tree's
#   tests   test_sampling_gpu.py -k "grid or cdf or bfloat16" on the patched source
#   abab    the kernel alone, 1 and 64 rows, bfloat16 lm / flat logits, Temperature and ReSET
#           + top-p, "cdf": tree / BAR_ARRIVE 1 / BAR_ARRIVE 2, alternated twice (about 100 s)
#   decode  the 36-layer NVFP4 decode loop at 1 row (256 new tokens) on the head's bfloat16
#           logits, greedy / temp / reset alternated within each process: tree / patch / tree /
#           patch (about 4 min: a device call of its own)
# The tree's source is restored when the script ends.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: same tests abab decode)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in same | tests | abab | decode) ;; *)
    echo "unknown step '$step': expected same, tests, abab or decode" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
work=/tmp/barrier_patch
x=$out/x
mkdir -p "$x" $work
log=$out/barrier_patch.log
src=cuda_ops/sampler.cu
cp $src $work/tree.cu
git apply --include=$src experiments/kernels/sampler_grid_barrier.patch \
  || { echo "the patch does not apply" | tee -a "$log"; exit 1; }
cp $src $work/new.cu
trap 'cp $work/tree.cu $src' EXIT
# use VARIANT: the source and the "cdf" constants of tree / b1 / b2
use() {
  case $1 in
  tree) cp $work/tree.cu $src; export CDF_DEFINES= ;;
  b1) cp $work/new.cu $src; export CDF_DEFINES= ;;
  b2) cp $work/new.cu $src; export CDF_DEFINES=BAR_ARRIVE=2 ;;
  esac
}
wrap=experiments/kernels/cdf_defines.py
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  same)
    for v in tree b1 b2; do
      use $v
      t0=$(date +%s)
      timeout 200 python3 $wrap experiments/kernels/sampler_draws_dump.py --out "$x/draws_$v.npz" \
        > "$x/draws_$v.log" 2>&1
      stamp "dump $v" $? $t0
    done
    for v in b1 b2; do
      python3 experiments/kernels/sampler_draws_dump.py --compare "$x/draws_tree.npz" \
        "$x/draws_$v.npz" 2>&1 | head -20 | tee -a "$log"
    done
    ;;
  tests)
    use b1
    timeout 240 python3 -m pytest tests/test_sampling_gpu.py -k "grid or cdf or bfloat16" \
      -p no:cacheprovider -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  abab)
    for v in tree b1 b2 tree b1 b2; do
      use $v
      t0=$(date +%s)
      timeout 60 python3 $wrap experiments/bench_sampler.py --batch 1 64 --logits lm flat \
        --methods kernel --variants cdf --samplers temperature_top_p reset_top_p \
        --stats two_pass --logits-dtype bfloat16 \
        --out "$x/abab_${v}_$t0.json" > "$x/abab_${v}_$t0.log" 2>&1
      stamp "abab $v" $? $t0
      grep -A7 "us over greedy" "$x/abab_${v}_$t0.log" | tee -a "$log"
    done
    ;;
  decode)
    for v in tree b1 tree b1; do
      use $v
      t0=$(date +%s)
      timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 \
        --repeats 3 --no-breakdown --samplers greedy temp reset greedy temp reset greedy \
        --logits-dtypes head --out "$x/decode_${v}_$t0.json" > "$x/decode_${v}_$t0.log" 2>&1
      stamp "decode $v" $? $t0
      grep -E "ms/token|rror" "$x/decode_${v}_$t0.log" | tee -a "$log"
    done
    ;;
  esac
done
tar czf "$out/barrier_patch_$(echo "$@" | tr ' ' _).tgz" -C "$out" x && rm -rf "$x"
