#!/usr/bin/env bash
# The GPU checks and timings of ticket_acq_rel.patch ([T2-B], batch 1): the decode attention's
# and the NORM_OUT GEMV's last-CTA tickets with acquire-release semantics, no fence.sc.
#
#   bash experiments/kernels/ticket_patch_run.sh OUT STEP...    (from the repository root)
#
# STEP (in the order given; logs and JSON under OUT):
#   tests    on the patched tree: test_decode_attention_cuda_gpu.py and
#            test_fused_linear_gpu.py -k norm_out_tail (exact comparisons; about 4 min)
#   profile  profile_step.py, 8 layers, 32 steps, batch 1 and 8, greedy: tree / patch
#            alternated twice (about 4 min): busy us a step and the attention's us a layer
# The tree is restored when the script ends.
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: $0 OUT STEP... (steps: tests profile)" >&2
  exit 2
fi
out=$1
shift
for step in "$@"; do
  case $step in tests | profile) ;; *)
    echo "unknown step '$step': expected tests or profile" >&2
    exit 2
    ;;
  esac
done
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rk}
patch=experiments/kernels/ticket_acq_rel.patch
x=$out/x
mkdir -p "$x"
log=$out/ticket_patch.log
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
    timeout 280 python3 -m pytest tests/test_decode_attention_cuda_gpu.py \
      tests/test_fused_linear_gpu.py -k "norm_out_tail or not test_fused_linear_gpu" \
      -p no:cacheprovider -rf > "$x/tests.log" 2>&1
    stamp tests $? $t0
    grep -E "passed|failed|FAILED|Error" "$x/tests.log" | tail -15 | tee -a "$log"
    ;;
  profile)
    for v in tree patch tree patch; do
      if [ $v = tree ]; then off; else on; fi
      t0=$(date +%s)
      timeout 110 python3 experiments/profile_step.py --layers 8 --steps 32 \
        --out "$x/profile_${v}_$t0.json" --variant nvfp4:1 --variant nvfp4:8 \
        > "$x/profile_${v}_$t0.log" 2>&1
      stamp "profile $v" $? $t0
      python3 - "$x/profile_${v}_$t0.json" <<'PY' | tee -a "$log"
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    c = r["classes"]
    print(f"  {r['variant']}: busy {r['busy_us_per_step']:.1f} us, span "
          f"{r['span_us_per_step']:.1f} us a step; attention "
          f"{c.get('attention', {}).get('us_per_layer', 0):.2f}, GEMV "
          f"{c.get('nvfp4_gemv', {}).get('us_per_layer', 0):.2f} us a layer")
PY
    done
    ;;
  esac
done
tar czf "$out/ticket_patch_$(echo "$@" | tr ' ' _).tgz" -C "$out" x && rm -rf "$x"
