#!/usr/bin/env bash
# session 58 call 1 (about 5-6 min), on branch s56-topk-plan: session 56's two pending calls in
# one, so a machine that comes late serves both:
#  1. s56/calls/call1.sh with one A/B round: the 46 GPU tests of the "grid" sampler (the top-k
#     plan of at most 64 CTAs a row among them), then that plan against the old geometry at
#     1, 2 and 4 rows, kernel alone;
#  2. s56/calls/call2.sh: the 36-layer batch-1 decode loop's optimized GPU HLO and the copies at
#     the top level of each while loop's body.
#   bash call1.sh OUT SHA
set -uo pipefail
out=$1 sha=$2
here=experiments/results/s56/calls
mkdir -p $out/c1 $out/c2
TEST_TIMEOUT=${TEST_TIMEOUT:-300} ROUNDS=${ROUNDS:-1} bash $here/call1.sh $out/c1 $sha
bash $here/call2.sh $out/c2
