#!/usr/bin/env bash
# session 23 call 7: ReSET's default ("auto" -> the grid kernel with the state update in the
# launch): the ReSET GPU tests and generation tests, then the decode loop at 1 row (adjacent
# repeats) with every sampler
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call7.log
mkdir -p $out/x
t0=$(date +%s)
timeout 140 python3 -m pytest tests/test_sampling_gpu.py -k "reset or auto or retrace or rows" -p no:cacheprovider -q -rf > $out/x/t_reset.log 2>&1
echo "pytest sampling reset rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -2 $out/x/t_reset.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 -m pytest tests/test_generate.py -k "reset or sampler" -p no:cacheprovider -q -rf > $out/x/t_generate.log 2>&1
echo "pytest generate rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
tail -2 $out/x/t_generate.log | tee -a $log
t0=$(date +%s)
timeout 100 python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 256 --repeats 3 \
  --no-breakdown --samplers greedy temp reset topk20 greedy temp reset topk20 \
  --out $out/decode_b1.json > $out/x/decode_b1.log 2>&1
echo "decode b1 rc=$? $(( $(date +%s)-t0 ))s" | tee -a $log
grep -E "ms/token" $out/x/decode_b1.log | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
