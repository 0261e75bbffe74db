#!/usr/bin/env bash
# session 51 call 6 ([T2-E] at 64 rows, where the decode loop's sampler costs 56-72 us over
# greedy on the H100 against 60 allowed):
#  1. profile_step: the decode step's kernels at 64 rows (and 1) under greedy / temp / reset, 4
#     layers (the sampler's share does not depend on the depth): what the loop adds around the
#     sampler kernel (the keys' fold_in, ReSET's state, the loop's copies)
#  2. ncu per-SASS warp-stall samples of "cdf" at 64 rows (bfloat16 lm logits, Temperature)
#  3. the kernel alone at 64 rows built with NC = 4 / 2 / 3 first draws, alternated
#     (experiments/kernels/cdf_nc.py with CDF_NC=n as run; since renamed cdf_defines.py, CDF_DEFINES=NC=n)
#  4. the GPU tests of "cdf" with NC = 2 (exactness: chi-square; CPU mirror with CDF_DRAWS = 2)
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call6.log
mkdir -p $out/x
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
stamp() { echo "$1 rc=$2 $(($(date +%s) - $3))s" | tee -a "$log"; }
t0=$(date +%s)
timeout 200 python3 experiments/profile_step.py --layers 4 --steps 32 --out $out/x/profile.json \
  --variant nvfp4:64:sampler=greedy --variant nvfp4:64:sampler=temp \
  --variant nvfp4:64:sampler=reset --variant nvfp4:1:sampler=greedy \
  --variant nvfp4:1:sampler=reset > $out/x/profile.log 2>&1
stamp profile $? $t0
tail -60 $out/x/profile.log | tee -a $log
t0=$(date +%s)
timeout 90 ncu --kernel-name rejax_sample_grid --launch-skip 4 --launch-count 1 \
  --section SourceCounters --section InstructionStats --section WarpStateStats --page source \
  --csv --print-source sass python3 experiments/bench_sampler.py --batch 64 --logits lm \
  --methods kernel --variants cdf --samplers temperature_top_p --steps 2 --repeats 1 \
  --stats two_pass --logits-dtype bfloat16 --out $out/x/ncu64.json > $out/x/cdf64_sass.csv \
  2> $out/x/ncu64.err
stamp ncu64 $? $t0
python3 experiments/ncu_sass_segments.py $out/x/cdf64_sass.csv 2>&1 | head -45 | tee -a $log
for nc in 4 2 3 4 2 3; do
  t0=$(date +%s)
  CDF_NC=$nc timeout 90 python3 experiments/kernels/cdf_nc.py experiments/bench_sampler.py \
    --batch 64 --logits lm flat --methods kernel --variants cdf \
    --samplers temperature_top_p reset_top_p --stats two_pass --logits-dtype bfloat16 \
    --out $out/x/nc${nc}_$t0.json > $out/x/nc${nc}_$t0.log 2>&1
  stamp "kernel NC=$nc" $? $t0
  grep -A6 "us over greedy" $out/x/nc${nc}_$t0.log | tee -a $log
done
t0=$(date +%s)
CDF_NC=2 PYTHONPATH=.:experiments/kernels timeout 200 python3 -m pytest -p cdf_nc \
  tests/test_sampling_gpu.py -k "cdf and not state" -p no:cacheprovider -q -rf \
  > $out/x/tests_nc2.log 2>&1
stamp "tests NC=2" $? $t0
grep -E "passed|failed|FAILED|Error" $out/x/tests_nc2.log | tail -15 | tee -a $log
tar czf $out/x.tgz -C $out x && rm -rf $out/x
