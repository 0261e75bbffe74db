#!/usr/bin/env bash
# session 58 call 2 (about 2 min): s56/calls/call2.sh, the 36-layer batch-1 decode loop's
# optimized GPU HLO and the copies at the top level of each while loop's body.
#   bash call2.sh OUT
exec bash experiments/results/s56/calls/call2.sh "$@"
