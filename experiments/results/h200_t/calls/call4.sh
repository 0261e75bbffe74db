#!/usr/bin/env bash
# session 22 call 4: the grid kernel with 4 candidates (GPU tests, kernel alone on lm and model
# logits); [T2-E] every sampler over greedy under the new auto (grid for top-p), batch 1
# (adjacent repeats) and 64; [T2-B] the layer scan's unroll 4 / 9 / 12 at batch 1
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call4.log
t0=$(date +%s)
timeout 150 python3 -m pytest tests/test_sampling_gpu.py -k "grid or default_auto" -p no:cacheprovider -q -rf > $out/t_grid.log 2>&1
echo "pytest grid rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -3 $out/t_grid.log | tee -a $log
t0=$(date +%s)
timeout 150 python3 experiments/bench_sampler.py --batch 1 64 --logits lm model --model-layers 2 --methods kernel \
  --variants grid reject merge --samplers temperature_top_p reset_top_p \
  --out $out/sampler_grid4.json > $out/sampler_grid4.log 2>&1
echo "bench_sampler rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -A8 "us over greedy" $out/sampler_grid4.log | tee -a $log
t0=$(date +%s)
timeout 230 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 topk20-merge greedy temp reset topk20 \
  --out $out/decode_samplers_b1.json > $out/decode_samplers_b1.log 2>&1
echo "decode samplers b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_samplers_b1.log | tee -a $log
t0=$(date +%s)
timeout 170 python3 experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 greedy \
  --out $out/decode_samplers_b64.json > $out/decode_samplers_b64.log 2>&1
echo "decode samplers b64 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_samplers_b64.log | tee -a $log
t0=$(date +%s)
timeout 150 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy --scan-unroll 4 9 12 4 9 12 \
  --out $out/decode_su_b1.json > $out/decode_su_b1.log 2>&1
echo "decode su b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/decode_su_b1.log | tee -a $log
