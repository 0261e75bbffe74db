#!/usr/bin/env bash
# session 20 call 2: the decode loop's own logits through the sampler variants (kernel alone);
# a kernel timeline of greedy vs Temperature in the 36-layer loop; the GEMM's KT default at M 8/16
set -uo pipefail
out=$1
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
t0=$(date +%s)
timeout 200 python3 experiments/bench_sampler.py --logits model --model-layers 36 --batch 1 64 \
  --methods kernel --variants split merge cluster reject --stats two_pass \
  --samplers temperature_top_p top_k20 reset_top_p --save-logits $out/model_logits.npz \
  --out $out/bench_sampler_model.json > $out/bench_sampler_model.log 2>&1
echo "bench_sampler rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep model_logit_profiles $out/bench_sampler_model.log | cut -c1-1500
sed -n '/^us over greedy/,$p' $out/bench_sampler_model.log
t0=$(date +%s)
timeout 170 python3 experiments/profile_step.py --layers 36 --steps 16 --variant nvfp4:1 \
  --variant nvfp4:1:sampler=temp --variant nvfp4:1:sampler=temp-reject --variant nvfp4:1:sampler=reset \
  --out $out/profile_samplers.json > $out/profile_samplers.log 2>&1
echo "profile rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -60 $out/profile_samplers.log | cut -c1-200
t0=$(date +%s)
timeout 130 python3 experiments/bench_gemm.py --ms 8,16 --shapes all --variants gemm,gemm_kt128,gemm_kt256 \
  --ops gemm_graph,jax_bf16 --time-budget 110 --out $out/bench_gemm_m8_16.json > $out/bench_gemm.log 2>&1
echo "bench_gemm rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "geomean" $out/bench_gemm.log | head -20
