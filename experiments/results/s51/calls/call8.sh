#!/usr/bin/env bash
# session 51 call 8 (the last 9 minutes; run as one command line): the decode loop at 64 rows,
# main's sampler.cu (base_sampler.cu, as call 7) against the patched tree with CDF_FAST_EXP=1,
# alternated twice; greedy / reset / temp, each process with its own greedy entries
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
mkdir -p /tmp/c8
cp cuda_ops/sampler.cu /tmp/c8/tree.cu
trap 'cp /tmp/c8/tree.cu cuda_ops/sampler.cu' EXIT
for v in fe1 base fe1 base; do
  if [ $v = base ]; then cp experiments/results/s51/calls/base_sampler.cu cuda_ops/sampler.cu; fe=0
  else cp /tmp/c8/tree.cu cuda_ops/sampler.cu; fe=1; fi
  echo "== $v"
  CDF_DEFINES=CDF_FAST_EXP=$fe timeout 100 python3 experiments/kernels/cdf_defines.py \
    experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 --repeats 3 --no-breakdown \
    --samplers greedy reset temp greedy reset temp greedy --logits-dtypes head \
    --out $out/d_${v}_$(date +%s).json 2>&1 | grep -E "ms/token|rror"
done
