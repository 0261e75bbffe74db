#!/usr/bin/env bash
# The GPU check and timings of sampler_cdf_bf16_stash.patch ([T2-E], batch 64): "cdf" on
# bfloat16 logits with each CTA's chunk in shared memory, against the tree's source.
#
#   bash experiments/kernels/stash_patch_run.sh OUT STEP...    (from the repository root)
#
# STEP (in the order given; logs and JSON under OUT):
#   tests   test_sampling_gpu.py -k "bfloat16 or (cdf and not chi_square)" on the patched source
#   abab    the kernel alone on bfloat16 logits, tree vs patched, alternated twice, at 32 and 64
#           rows, lm and flat logits, Temperature and ReSET + top-p (bench_sampler.py, "cdf")
#   decode  the 36-layer NVFP4 decode loop at 64 rows on the head's bfloat16 logits: greedy and
#           reset-cdf-state, tree vs patched, alternated (bench_decode.py)
# The tree's source is restored when the script ends.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests abab decode)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | abab | decode) ;; *)
    echo "unknown step '$step': expected tests, abab or decode" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
work=/tmp/stash_patch
x=$out/x
mkdir -p "$x" $work
log=$out/stash_patch.log
src=cuda_ops/sampler.cu
cp $src $work/tree.cu
git apply --include=$src experiments/kernels/sampler_cdf_bf16_stash.patch \
  || { echo "the patch does not apply" | tee -a "$log"; exit 1; }
cp $src $work/new.cu
use() { cp $work/$1.cu $src; }
trap 'cp $work/tree.cu $src' EXIT
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  tests)
    use new
    timeout 200 python3 -m pytest tests/test_sampling_gpu.py -k "bfloat16 or (cdf and not chi_square)" \
      -p no:cacheprovider -q -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  abab)
    for run in tree new tree new; do
      use $run
      t0=$(date +%s)
      timeout 60 python3 experiments/bench_sampler.py --batch 32 64 --logits lm flat \
        --methods kernel --variants cdf --samplers temperature_top_p reset_top_p \
        --stats two_pass --logits-dtype bfloat16 \
        --out "$x/abab_${run}_$t0.json" > "$x/abab_${run}_$t0.log" 2>&1
      stamp "abab $run" $? $t0
      grep -A5 "us over greedy" "$x/abab_${run}_$t0.log" | tee -a "$log"
    done
    ;;
  decode)
    for run in tree new tree new; do
      use $run
      t0=$(date +%s)
      timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 \
        --repeats 3 --no-breakdown --samplers greedy reset-cdf-state --logits-dtypes head \
        --out "$x/decode_${run}_$t0.json" > "$x/decode_${run}_$t0.log" 2>&1
      stamp "decode $run" $? $t0
      grep -E "ms/token|rror" "$x/decode_${run}_$t0.log" | tee -a "$log"
    done
    ;;
  esac
done
tar czf "$out/stash_patch_$(echo "$@" | tr ' ' _).tgz" -C "$out" x && rm -rf "$x"
