#!/usr/bin/env bash
# session 53 call 2 (about 7 min), on the tree with the step folded in the sampler's launch:
#  1. tests/test_sample_step.py on the GPU (call 1's two failures fixed: the reference jitted
#     too, and the register check skipped where NVRTC's log has no ptxas report) and
#     test_sampling_gpu.py -k fold_the_step
#  2. profile_step.py, 4 layers, 32 steps, 64 rows Temperature / ReSET and 1 row ReSET: the
#     loops folding in XLA (experiments/loop_fold_off.py) / in the launch, alternated twice
#  3. test_fused_linear_gpu.py -k "swiglu_epilogue and 24576" with its weights passed as
#     arguments (it ran past 200 s in sessions 46 and 52)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
x=$out/x
mkdir -p $x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
t0=$(date +%s)
timeout 200 python3 -m pytest tests/test_sample_step.py tests/test_sampling_gpu.py -k \
  "fold_the_step or not test_sampling_gpu" -p no:cacheprovider -rfs > $x/tests.log 2>&1
stamp tests $? $t0
grep -a -E "passed|failed|FAILED|SKIPPED|Error" $x/tests.log | tail -15 | tee -a $log
for v in xla launch xla launch; do
  pre=""
  [ $v = xla ] && pre=experiments/loop_fold_off.py
  t0=$(date +%s)
  timeout 120 python3 $pre experiments/profile_step.py --layers 4 --steps 32 \
    --out "$x/profile_${v}_$t0.json" --variant nvfp4:64:sampler=temp \
    --variant nvfp4:64:sampler=reset --variant nvfp4:1:sampler=reset \
    > "$x/profile_${v}_$t0.log" 2>&1
  stamp "profile $v" $? $t0
  python3 - "$x/profile_${v}_$t0.json" <<'PY' | tee -a $log
import json, sys
for r in json.load(open(sys.argv[1]))["results"]:
    k = {t["name"]: t["us_per_step"] for t in r["top"]}
    print(f"  {r['variant']}: busy {r['busy_us_per_step']:.1f} us, {r['launches_per_step']:.2f} "
          f"launches a step; sampler {k.get('rejax_sample_grid', 0):.1f}, "
          f"concatenate {k.get('input_concatenate_fusion', 0):.2f} us")
PY
done
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_fused_linear_gpu.py -k "swiglu_epilogue and 24576" \
  -p no:cacheprovider -rf -o faulthandler_timeout=140 > $x/swiglu24576.log 2>&1
stamp swiglu24576 $? $t0
grep -a -E "passed|failed|Timeout" $x/swiglu24576.log | tail -5 | tee -a $log
tar czf $out/call2.tgz -C $out x && rm -rf $x
