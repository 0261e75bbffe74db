#!/usr/bin/env bash
# session 51 call 7 ([T2-E] at 64 rows): the "cdf" statistics sweep held 45% of the kernel's
# instructions at 64 rows (call 6's ncu), most of them CUDA's expf (three a token for ReSET).
# The tree now skips ReSET's t = 1 exp (the same bits) and offers CDF_FAST_EXP (hardware exp2).
#  1. GPU tests of "cdf" on the tree's source, then with CDF_FAST_EXP=1
#  2. kernel alone, 1 and 64 rows, bfloat16 lm / flat logits: base (main's source) / tree /
#     tree + CDF_FAST_EXP, alternated twice
#  3. decode loop 36 layers at 64 rows: base / tree + CDF_FAST_EXP / base, greedy temp reset
# The tree it ran: main at ca3cf3b with experiments/kernels/sampler_cdf_fast_exp.patch applied;
# base_sampler.cu was main's source (`git show ca3cf3b:cuda_ops/sampler.cu`), written before the
# call and not kept.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call7.log
mkdir -p $out/x /tmp/c7
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
src=cuda_ops/sampler.cu
cp $src /tmp/c7/tree.cu
cp experiments/results/s51/calls/base_sampler.cu /tmp/c7/base.cu
trap 'cp /tmp/c7/tree.cu $src' EXIT
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
for fe in 0 1; do
  t0=$(date +%s)
  CDF_DEFINES=CDF_FAST_EXP=$fe PYTHONPATH=.:experiments/kernels timeout 200 python3 -m pytest \
    -p cdf_defines tests/test_sampling_gpu.py -k cdf -p no:cacheprovider -rf \
    > $out/x/tests_fe$fe.log 2>&1
  stamp "tests FAST_EXP=$fe" $? $t0
  grep -E "passed|failed|FAILED|Error" $out/x/tests_fe$fe.log | tail -12 | tee -a $log
done
for v in base fe0 fe1 base fe0 fe1; do
  t0=$(date +%s)
  if [ $v = base ]; then cp /tmp/c7/base.cu $src; fe=0; else cp /tmp/c7/tree.cu $src; fe=${v#fe}; fi
  CDF_DEFINES=CDF_FAST_EXP=$fe timeout 90 python3 experiments/kernels/cdf_defines.py \
    experiments/bench_sampler.py --batch 1 64 --logits lm flat --methods kernel --variants cdf \
    --samplers temperature_top_p reset_top_p --stats two_pass --logits-dtype bfloat16 \
    --out $out/x/k_${v}_$t0.json > $out/x/k_${v}_$t0.log 2>&1
  stamp "kernel $v" $? $t0
  grep -A7 "us over greedy" $out/x/k_${v}_$t0.log | tee -a $log
done
for v in base fe1 base; do
  t0=$(date +%s)
  if [ $v = base ]; then cp /tmp/c7/base.cu $src; fe=0; else cp /tmp/c7/tree.cu $src; fe=1; fi
  CDF_DEFINES=CDF_FAST_EXP=$fe timeout 150 python3 experiments/kernels/cdf_defines.py \
    experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 \
    --no-breakdown --samplers greedy temp reset greedy temp reset greedy --logits-dtypes head \
    --out $out/x/d_${v}_$t0.json > $out/x/d_${v}_$t0.log 2>&1
  stamp "decode $v" $? $t0
  grep -E "ms/token|rror" $out/x/d_${v}_$t0.log | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
