#!/usr/bin/env bash
# session 54 call 1. On an H200: [T2-E]'s acceptance row on this tree
# (../../s51/calls/call5.sh, about 6.5 min). On another card:
#  1. ticket_patch_run.sh tests (the decode attention's GPU tests incl. the repinned
#     test_decoder_nvfp4_outputs_gpu, and norm_out_tail, on the ticket patch; about 4 min)
#  2. on the tree, test_fused_linear_gpu.py's two shape sweeps with their weights passed as
#     arguments (not rerun on a GPU since that change)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
log=$out/call1.log
echo "$gpu" | tee -a $log
if echo "$gpu" | grep -q H200; then
  exec bash experiments/results/s51/calls/call5.sh $out
fi
bash experiments/kernels/ticket_patch_run.sh $out tests
mkdir -p $out/y
t0=$(date +%s)
timeout 250 python3 -m pytest tests/test_fused_linear_gpu.py -k \
  "in_kernel_quantization_equals or fused_ops_match" -p no:cacheprovider -rf --durations=5 \
  -o faulthandler_timeout=240 > $out/y/sweeps.log 2>&1
echo "sweeps rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -a -E "passed|failed|FAILED|Timeout|s call" $out/y/sweeps.log | tail -12 | tee -a $log
tar czf $out/call1.tgz -C $out x y && rm -rf $out/x $out/y
