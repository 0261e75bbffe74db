#!/usr/bin/env bash
# for the next session (about 8 min):
#  H200: [T2-E]'s acceptance row under today's default (s51's call5.sh: 36-layer NVFP4 decode
#        loop, batch 1 and 64, every sampler alternated with greedy, medians of 5 an entry).
#  H100: profile_step at 64 and 1 rows (4 layers): the sampler kernel's time in the loop now
#        that its sweeps load ahead (s51 call 6: 71.6 / 77.7 us at 64 rows), and the sampler
#        path's other kernels.
#  Then, on either card: test_fused_linear_gpu.py -k "swiglu_epilogue and 24576" alone, with
#  every XLA compile logged (JAX_LOG_COMPILES) and Python's stacks dumped after 150 s: it has
#  never finished inside 190-200 s (sessions 46 and 52), and NVRTC + ptxas of its SwiGLU GEMVs
#  take 0.1-0.3 s each here, so the log says which phase holds it.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/next.log
mkdir -p $out/x
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu" | tee -a $log
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
if echo "$gpu" | grep -q H200; then
  bash experiments/results/s51/calls/call5.sh $out
else
  t0=$(date +%s)
  timeout 200 python3 experiments/profile_step.py --layers 4 --steps 32 --out $out/x/profile.json \
    --variant nvfp4:64:sampler=greedy --variant nvfp4:64:sampler=temp \
    --variant nvfp4:64:sampler=reset --variant nvfp4:1:sampler=greedy \
    --variant nvfp4:1:sampler=reset > $out/x/profile.log 2>&1
  stamp profile $? $t0
  grep -E "rejax_sample|busy|variant" $out/x/profile.log | head -40 | tee -a $log
fi
t0=$(date +%s)
JAX_LOG_COMPILES=1 timeout 220 python3 -m pytest tests/test_fused_linear_gpu.py \
  -k "swiglu_epilogue and 24576" -p no:cacheprovider -p no:logging -s -rf \
  -o faulthandler_timeout=150 > $out/x/swiglu24576.log 2>&1
stamp swiglu24576 $? $t0
grep -E "Finished|passed|failed|Timeout|File \"" $out/x/swiglu24576.log | tail -40 | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
