#!/usr/bin/env bash
# The GPU checks and timings of the grid sampler's three patches ([T2-E], batch 64), applied in
# order on cuda_ops/sampler.cu as it was at BASE (below: they predate the grid sweeps' loads
# ahead, and lost in the thirty-third session), the "tree" of every comparison here:
# sampler_grid_word_skip.patch, sampler_grid_mass_bounds.patch, sampler_grid_sums_t1.patch
# (each patch's header says what it changes and what to check). Needs the git history.
#
#   bash experiments/kernels/grid_patches_run.sh [-n N] OUT STEP...    (from the repository root)
#
# -n N applies the first N patches only (1-3, default 3), to tell the patches' effects apart.
# STEP (they run in the order given, logs and JSON under OUT; the timeouts keep "tests abab",
# "ncu sanitize" and "decode" each within one 600 s device call):
#   tests   test_sampling_gpu.py -k "grid or default_auto or reset" on the patched source
#   abab    the kernel alone, tree vs patched, alternated twice (tree, new, tree, new) at 1, 8
#           and 64 rows on lm and flat logits, Temperature and ReSET + top-p (bench_sampler.py)
#   ncu     per-SASS counters of the patched grid kernel at 64 rows, flat logits (Temperature;
#           read with experiments/ncu_sass_segments.py; the tree's count was 56.8M warp
#           instructions, experiments/results/h200_v/call6_*)
#   sanitize  compute-sanitizer memcheck and racecheck of the patched grid kernel, top-p
#   decode  the 36-layer NVFP4 decode loop, patched, batch 64 then 1: greedy / Temperature /
#           ReSET alternated three times (bench_decode.py); before: +78 / +85 us at batch 64
# OUT gets the summary log (grid_patches.log) and one tarball of every step's logs, JSON and ncu
# CSV (grid_patches_STEPS.tgz: a device call brings back at most 8 files). The patched source
# stays in place when the script ends (`git checkout cuda_ops/sampler.cu` restores the tree's).
set -uo pipefail
npatch=3
if [ "${1:-}" = "-n" ]; then
  npatch=${2:-}
  shift 2
  case $npatch in 1 | 2 | 3) ;; *) echo "-n '$npatch': expected 1, 2 or 3" >&2; exit 2 ;; esac
fi
if [ $# -lt 2 ]; then
  echo "usage: $0 [-n N] OUT STEP... (steps: tests abab ncu sanitize decode)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | abab | ncu | sanitize | decode) ;; *)
    echo "unknown step '$step': expected tests, abab, ncu, sanitize or decode" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
work=/tmp/grid_patches/n$npatch
x=$out/x  # every step's files; tarred at the end
mkdir -p "$out" "$x" $work
log=$out/grid_patches.log
src=cuda_ops/sampler.cu
BASE=cf59efc  # the patches' cuda_ops/sampler.cu
kdir=experiments/kernels
if [ ! -f $work/new.cu ]; then  # the tree's source, once, before any patch is applied
  [ -f /tmp/grid_patches/tree.cu ] || git show $BASE:$src > /tmp/grid_patches/tree.cu \
    || { echo "no git history with $BASE" | tee -a "$log"; exit 1; }
  cp /tmp/grid_patches/tree.cu $src
  for p in sampler_grid_word_skip sampler_grid_mass_bounds sampler_grid_sums_t1; do
    [ $npatch -gt 0 ] || break
    npatch=$((npatch - 1))
    git apply --include=$src $kdir/$p.patch || { echo "$p.patch does not apply" | tee -a "$log"; exit 1; }
  done
  cp $src $work/new.cu
fi
echo "patched source: $work/new.cu" | tee -a "$log"
use() { if [ $1 = tree ]; then cp /tmp/grid_patches/tree.cu $src; else cp $work/new.cu $src; fi; }
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  tests)
    use new
    timeout 300 python3 -m pytest tests/test_sampling_gpu.py -k "grid or default_auto or reset" \
      -p no:cacheprovider -q -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  abab)
    for run in tree new tree new; do
      use $run
      t0=$(date +%s)
      timeout 70 python3 experiments/bench_sampler.py --batch 1 8 64 --logits lm flat \
        --methods kernel-grid --samplers temperature_top_p reset_top_p --stats two_pass \
        --out "$x/abab_${run}_$t0.json" > "$x/abab_${run}_$t0.log" 2>&1
      stamp "abab $run" $? $t0
      grep -A7 "us over greedy" "$x/abab_${run}_$t0.log" | tee -a "$log"
    done
    use new
    ;;
  ncu)
    use new
    timeout 60 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
      --section SourceCounters --section InstructionStats --page source --csv --print-source sass \
      python3 experiments/bench_sampler.py --batch 64 --logits flat --methods kernel-grid \
      --samplers temperature_top_p --steps 2 --repeats 1 --out /tmp/grid_patches/ncu.json \
      > "$x/ncu_grid64_flat_temp_sass.csv" 2> "$x/ncu.err"
    stamp ncu $? $t0
    python3 experiments/ncu_sass_segments.py "$x/ncu_grid64_flat_temp_sass.csv" 2>&1 | tail -25 | tee -a "$log"
    gzip -9f "$x/ncu_grid64_flat_temp_sass.csv"
    ;;
  sanitize)
    use new
    for tool in memcheck racecheck; do
      t0=$(date +%s)
      timeout 150 compute-sanitizer --tool $tool --kernel-name kns=rejax_sample --print-limit 20 \
        python3 experiments/bench_sampler.py --batch 1 8 64 --logits flat --methods kernel-grid \
        --samplers temperature_top_p reset_top_p --steps 2 --repeats 1 \
        --out /tmp/grid_patches/san.json > "$x/sanitize_$tool.log" 2>&1
      stamp "sanitize $tool" $? $t0
      grep -E "ERROR SUMMARY|RACECHECK SUMMARY|hazard" "$x/sanitize_$tool.log" | head -4 | tee -a "$log"
    done
    ;;
  decode)
    use new
    for b in 64 1; do
      t0=$(date +%s)
      len=$([ $b = 64 ] && echo 128 || echo 256)
      limit=$([ $b = 64 ] && echo 220 || echo 140)
      timeout $limit python3 experiments/bench_decode.py --modes nvfp4 --batch $b --gen-len $len \
        --repeats 3 --no-breakdown \
        --samplers greedy temp reset greedy temp reset greedy temp reset \
        --out "$x/decode_b$b.json" > "$x/decode_b$b.log" 2>&1
      stamp "decode b$b" $? $t0
      grep -E "ms/token|rror" "$x/decode_b$b.log" | tee -a "$log"
    done
    ;;
  esac
done
tar czf "$out/grid_patches_$(echo "$@" | tr ' ' _).tgz" -C "$out" x && rm -rf "$x"
