#!/usr/bin/env bash
# [T2-D] decode attention alone on one GPU, in about a minute: the Pallas kernel's default and a
# few launch variants, each checked against the reference (outputs poisoned), then timed at
# batch 1 and 8 over a 33,280-slot cache at live 1 (the fixed cost), 1K, 8K and 32K, raw and net
# of a control loop (experiments/bench_attention.py's docstring). Writes OUTDIR/bench_attention.json
# and .log, prints the check verdicts and the summary table.
# Usage: experiments/attention_device_run.sh OUTDIR [more bench_attention.py arguments]
# Environment: ATTN_VARIANTS (the --pallas-variants list), ATTN_TIMEOUT (s, default 145).
set -uo pipefail
out=${1:?output dir}; shift
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
variants=${ATTN_VARIANTS:-default stages=1 stages=3 warps=8 blocks=2,stages=1 prefetch=1,stages=1 block_s=128,stages=1}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv > "$out/env.txt" 2>&1
# --budget-s: no new timing starts after it, so the table prints before the timeout
# shellcheck disable=SC2086  # the variants are separate arguments
timeout "${ATTN_TIMEOUT:-145}" python3 experiments/bench_attention.py --impls pallas \
  --slots 33280 --batch 1 8 --live 1 1024 8192 32768 --steps 8 --unroll 16 --repeats 5 \
  --check-shapes 1x33280 8x2048 --prefill-lens --copy-mib 1024 --budget-s 115 \
  --pallas-variants $variants --out "$out/bench_attention.json" "$@" \
  > "$out/bench_attention.log" 2>&1
rc=$?
echo "bench_attention rc=$rc"
grep -E "FAIL|Error|check B=|^copy ceiling|B=.*control loop" "$out/bench_attention.log" | head -24
if grep -q "^us per call, net" "$out/bench_attention.log"; then
  sed -n '/^us per call, net/,$p' "$out/bench_attention.log"
else
  tail -30 "$out/bench_attention.log"
fi
exit $rc
