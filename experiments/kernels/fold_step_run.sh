#!/usr/bin/env bash
# The GPU checks and timings of sampler_fold_step.patch ([T2-E]): the decode loops hand their
# step to the sampler op and the grid kernels fold it into the row keys in their launch.
#
#   bash experiments/kernels/fold_step_run.sh OUT STEP...    (from the repository root)
#
# STEP (in the order given; logs and JSON under OUT):
#   tests    on the patched tree: test_sampling_gpu.py -k "fold_the_step or grid_state or
#            repeats_its_bits or default_auto" and tests/test_sample_step.py (on the GPU its
#            "kernel" cases run the kernels), about 4 min
#   same     sampler_draws_dump.py on the tree and on the patched tree (their builds without the
#            step): every token, entropy, temperature and state word bit for bit (about 2 min)
#   profile  profile_step.py, 4 layers, 32 steps, 64 rows Temperature / ReSET and 1 row ReSET:
#            the loops folding in XLA (experiments/loop_fold_off.py) / in the launch, alternated
#            twice (about 3 min): busy us and launches a step
# The tree is restored when the script ends.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests same profile)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | same | profile) ;; *)
    echo "unknown step '$step': expected tests, same or profile" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
patch=experiments/kernels/sampler_fold_step.patch
x=$out/x
mkdir -p "$x"
log=$out/fold_step.log
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
applied=0
on() { [ $applied = 1 ] || { git apply $patch && applied=1; }; }
off() { [ $applied = 0 ] || { git apply -R $patch && applied=0; }; }
trap off EXIT
git apply --check $patch || { echo "the patch does not apply" | tee -a "$log"; exit 1; }

for step in "$@"; do
  t0=$(date +%s)
  case $step in
  tests)
    on
    timeout 300 python3 -m pytest tests/test_sampling_gpu.py tests/test_sample_step.py -k \
      "fold_the_step or grid_state or repeats_its_bits or default_auto or not test_sampling_gpu" \
      -p no:cacheprovider -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  same)
    for v in tree patch; do
      if [ $v = tree ]; then off; else on; fi
      t0=$(date +%s)
      timeout 200 python3 experiments/kernels/sampler_draws_dump.py --out "$x/draws_$v.npz" \
        > "$x/draws_$v.log" 2>&1
      stamp "dump $v" $? $t0
    done
    python3 experiments/kernels/sampler_draws_dump.py --compare "$x/draws_tree.npz" \
      "$x/draws_patch.npz" 2>&1 | head -20 | tee -a "$log"
    rm -f "$x"/draws_*.npz
    ;;
  profile)
    on
    for v in xla launch xla launch; do
      pre=""
      [ $v = xla ] && pre=experiments/loop_fold_off.py
      t0=$(date +%s)
      timeout 120 python3 $pre experiments/profile_step.py --layers 4 --steps 32 \
        --out "$x/profile_${v}_$t0.json" --variant nvfp4:64:sampler=temp \
        --variant nvfp4:64:sampler=reset --variant nvfp4:1:sampler=reset \
        > "$x/profile_${v}_$t0.log" 2>&1
      stamp "profile $v" $? $t0
      python3 - "$x/profile_${v}_$t0.json" <<'PY' | tee -a "$log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    k = {t["name"]: t["us_per_step"] for t in r["top"]}
    print(f"  {r['variant']}: busy {r['busy_us_per_step']:.1f} us, {r['launches_per_step']:.2f} "
          f"launches a step; sampler {k.get('rejax_sample_grid', 0):.1f}, "
          f"concatenate {k.get('input_concatenate_fusion', 0):.2f} us")
PY
    done
    ;;
  esac
done
tar czf "$out/fold_step_$(echo "$@" | tr ' ' _).tgz" -C "$out" x && rm -rf "$x"
