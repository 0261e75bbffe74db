#!/usr/bin/env bash
# for the next session ([T2-E] at 64 rows, about 5.5 min): the decode loop with the sampler's
# per-row hyperparameters broadcast once before the loop (main since this session,
# rejax.sampling.broadcast_rows) against every step broadcasting them again
# (experiments/loop_rows_off.py), alternated: off / on / off / on, 36 layers, 64 rows, 128 new
# tokens, head logits; each process greedy / temp / reset twice with greedy between. The
# profile of call 6 counted 2 (Temperature) and 3 (ReSET) broadcast kernels a step at 64 rows,
# about 2.2 / 3.4 us of GPU time plus their launch gaps; at 1 row a broadcast is a reshape.
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/next_rows.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
for v in off on off on; do
  t0=$(date +%s)
  pre=""
  [ $v = off ] && pre=experiments/loop_rows_off.py
  timeout 100 python3 $pre experiments/bench_decode.py --modes nvfp4 --batch 64 --gen-len 128 \
    --repeats 3 --no-breakdown --samplers greedy temp reset greedy temp reset greedy \
    --logits-dtypes head --out $out/x/rows_${v}_$t0.json > $out/x/rows_${v}_$t0.log 2>&1
  echo "rows $v rc=$? $(($(date +%s) - t0))s" | tee -a $log
  grep -E "ms/token|rror" $out/x/rows_${v}_$t0.log | tee -a $log
done
python3 experiments/results/s51/over_greedy.py $out/x/rows_*.json | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
