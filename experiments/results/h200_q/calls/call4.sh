#!/usr/bin/env bash
# session 19 call 4: fixed-cost trims of the one-launch attention (this tree) vs before (.base_t), GPU tests
set -uo pipefail
out=$1
export XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1 REJAX_KERNEL_CACHE=/tmp/rk
V="default mma=1,splits=16,warps=8 mma=1,warps=8,stages=2 mma=1,splits=32"
A="--impls pallas cuda --pallas-variants default --slots 33280 --batch 1 8 --live 1 1024 8192 32768 --steps 8 --unroll 16 --repeats 5 --check-shapes 1x33280 8x2048 3x4100 --prefill-lens --copy-mib 1024 --budget-s 110"
for tree in new base new2; do
  t0=$(date +%s)
  if [ $tree = base ]; then d=.base_t; else d=.; fi
  (cd $d && PYTHONPATH=. timeout 130 python3 experiments/bench_attention.py $A --cuda-variants $V --out /tmp/ba_$tree.json > /tmp/ba_$tree.log 2>&1)
  echo "== $tree rc=$? $(( $(date +%s) - t0 )) s"
  grep -E "FAIL|Error|check B=" /tmp/ba_$tree.log | head -8
  sed -n '/^us per call, net/,$p' /tmp/ba_$tree.log | head -20
done 2>&1 | tee $out/bench_ab.txt
cp /tmp/ba_new.json $out/bench_attention_new.json; cp /tmp/ba_base.json $out/bench_attention_base.json; cp /tmp/ba_new2.json $out/bench_attention_new2.json
export PYTHONPATH=.
timeout 260 python3 -m pytest -q -rA --failures-now -m gpu tests/test_decode_attention_cuda_gpu.py -p no:cacheprovider > $out/t_attn.log 2>&1; echo "attn rc=$?"
grep -E "PASSED|FAILED|^E " $out/t_attn.log | head -30
