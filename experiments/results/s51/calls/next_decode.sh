#!/usr/bin/env bash
# for the next session ([T2-E] at 64 rows, about 8.5 min): the 36-layer NVFP4 decode loop at 64
# rows (128 new tokens, head logits), three builds alternated twice, each process timing
# greedy / temp / reset twice with greedy between (bench_decode.py reports each run over the
# greedy runs beside it):
#   off   every step broadcasts the sampler's scalar hyperparameters again
#         (experiments/loop_rows_off.py: the loop before rejax.sampling.broadcast_rows)
#   on    main: the hyperparameters broadcast once, before the loop
#   ahead main + experiments/kernels/sampler_grid_ahead.patch (sweep loads one trip ahead; run
#         `ahead_patch_run.sh OUT same tests` first: its draws must be main's bit for bit)
# Call 6's profile counted 2 (Temperature) / 3 (ReSET) broadcast kernels a step at 64 rows.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/next_decode.log
src=cuda_ops/sampler.cu
mkdir -p $out/x /tmp/nd
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
cp $src /tmp/nd/tree.cu
git apply --include=$src experiments/kernels/sampler_grid_ahead.patch \
  || { echo "the patch does not apply" | tee -a $log; exit 1; }
cp $src /tmp/nd/ahead.cu
trap 'cp /tmp/nd/tree.cu $src' EXIT
for v in off on ahead off on ahead; do
  t0=$(date +%s)
  pre=""
  [ $v = off ] && pre=experiments/loop_rows_off.py
  if [ $v = ahead ]; then cp /tmp/nd/ahead.cu $src; else cp /tmp/nd/tree.cu $src; fi
  timeout 95 python3 $pre experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 \
    --repeats 3 --no-breakdown --samplers greedy temp reset greedy temp reset greedy \
    --logits-dtypes head --out $out/x/d_${v}_$t0.json > $out/x/d_${v}_$t0.log 2>&1
  echo "decode $v rc=$? $(($(date +%s) - t0))s" | tee -a $log
  grep -E "ms/token|over greedy|rror" $out/x/d_${v}_$t0.log | tee -a $log
done
tar czf $out/x.tgz -C $out x && rm -rf $out/x
