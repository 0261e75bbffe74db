#!/usr/bin/env bash
# session 55 call 2: [T2-E]'s -76 us at batch 1 (session 54: in one bench_sampler process the
# 36-layer greedy decode loop ran 75 us a token slower than ReSET's): the device-kernel
# timeline of the 36-layer NVFP4 decode step at batch 1, prompt 128 as bench_sampler's, greedy,
# ReSET, greedy, Temperature in one process (profile_step.py; per kernel name and class).
#   bash call2.sh OUT
set -uo pipefail
out=$1
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false REJAX_KERNEL_CACHE=/tmp/rk
log=$out/call2.log
nvidia-smi --query-gpu=name --format=csv,noheader | tee -a $log
t0=$(date +%s)
timeout 420 python3 experiments/profile_step.py --layers 36 --prompt-len 128 --steps 32 \
  --variant nvfp4:1:sampler=greedy --variant nvfp4:1:sampler=reset \
  --variant nvfp4:1:sampler=greedy --variant nvfp4:1:sampler=temp \
  --out $out/profile_36l_b1.json > $out/profile.log 2>&1
echo "profile rc=$? $(($(date +%s) - t0))s" | tee -a $log
grep -aE "^\[|^   |rror" $out/profile.log | cut -c1-200 | tee -a $log
python3 - $out/profile_36l_b1.json <<'PY' | tee -a $log
import json, sys
d = json.load(open(sys.argv[1]))
for r in d["results"]:
    if "error" in r:
        print(r["variant"], r["error"]); continue
    print(r["variant"], "bench ms/token", r["ms_per_token_bench"], "busy",
          round(r.get("busy_us_per_step", 0), 1), "span", round(r.get("span_us_per_step", 0), 1))
    for k in r.get("top", [])[:14]:
        print("   ", round(k["us_per_step"], 1), round(k["per_step"], 2), k["name"][:90])
PY
