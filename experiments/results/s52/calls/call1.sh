#!/usr/bin/env bash
# session 52 call 1: on an H200, [T2-E]'s acceptance row (s51 call5.sh) first, then the ahead
# patch's bit-for-bit and GPU-test checks; on an H100 the ahead patch's checks and kernel timings.
set -uo pipefail
out=$1
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader)
echo "$gpu" | tee $out/gpu.txt
if echo "$gpu" | grep -q H200; then
  bash experiments/results/s51/calls/call5.sh $out
  bash experiments/kernels/ahead_patch_run.sh $out same tests
else
  bash experiments/kernels/ahead_patch_run.sh $out same tests abab
fi
