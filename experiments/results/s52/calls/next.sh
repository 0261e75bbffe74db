#!/usr/bin/env bash
# for the next session (about 8 min on an H200, 4 on an H100):
#  H200: [T2-E]'s acceptance row under today's default (s51's call5.sh: 36-layer NVFP4 decode
#        loop, batch 1 and 64, every sampler alternated with greedy, medians of 5 an entry).
#  Then, on either card: test_fused_linear_gpu.py -k "swiglu_epilogue and 24576" alone, with
#  every XLA compile logged (JAX_LOG_COMPILES) and Python's stacks dumped after 150 s: it has
#  never finished inside 190-200 s (sessions 46 and 52), and NVRTC + ptxas of its SwiGLU GEMVs
#  take 0.1-0.3 s each here, so the log says which phase holds it.
# (On an H100, experiments/kernels/fold_step_run.sh's profile step times the sampler path in
# the loop, this session's loads-ahead kernel included.)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/next.log
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu" | tee -a $log
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
if echo "$gpu" | grep -q H200; then
  bash experiments/results/s51/calls/call5.sh $out  # its files: $out/x.tgz
fi
mkdir -p $out/y
t0=$(date +%s)
JAX_LOG_COMPILES=1 timeout 220 python3 -m pytest tests/test_fused_linear_gpu.py \
  -k "swiglu_epilogue and 24576" -p no:cacheprovider -p no:logging -s -rf \
  -o faulthandler_timeout=150 > $out/y/swiglu24576.log 2>&1
stamp swiglu24576 $? $t0
grep -E "Finished|passed|failed|Timeout|File \"" $out/y/swiglu24576.log | tail -40 | tee -a $log
tar czf $out/y.tgz -C $out y && rm -rf $out/y
