#!/usr/bin/env bash
# [T2-E] on the H200: the sampler kernel's variants, "split" (the default, three kernels),
# "cluster" (one launch, a cluster of 8 CTAs per row) and "merge" (split with top-k drawn from
# per-block candidates). Usage: experiments/sampler_device_run.sh OUT [phases]; phases
# (default: env pytest bench table):
#   env     GPU, driver, clocks, versions, tree
#   pytest  GPU tests of tests/test_sampling_gpu.py -k "$PYTEST_K" (default "cluster"; "merge"
#           for the merge variant's), PYTEST_TIMEOUT (default 95 s); OUT/gpu_tests.log (-v, so
#           a timeout still shows which ran)
#   bench   kernel alone in a jitted scan (bench_sampler.py), LOGITS (default lm; one kind, the
#           table keys on batch and variant) logits, VARIANTS (default "split cluster merge")
#           for Temperature + top-p, top-k 20 and ReSET + top-p, one process per batch in
#           BATCHES (default "1 64", BENCH_TIMEOUT each, default 45 s);
#           OUT/bench_sampler_b{B}.json
#   table   us over greedy per sampler, batch and variant from the bench JSONs, next to the
#           issue's targets (15 us at batch 1, 60 us at batch 64)
# The whole default run takes about 3 minutes.
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env pytest bench table}
export PYTHONPATH=. PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import jax; from cuda_ops.build import nvrtc_version; \
print('jax', jax.__version__, 'nvrtc', nvrtc_version(), jax.devices())"
        git rev-parse HEAD 2>/dev/null; git status --short 2>/dev/null | head -20
      } > "$out/env.txt" 2>&1; cat "$out/env.txt";;
    pytest)
      timeout "${PYTEST_TIMEOUT:-95}" python3 -m pytest -m gpu tests/test_sampling_gpu.py \
        -k "${PYTEST_K:-cluster}" -v --tb=short -rfE --durations=5 -p no:cacheprovider \
        > "$out/gpu_tests.log" 2>&1
      rc=$?
      echo "pytest exit $rc (124: timed out); passed $(grep -c ' PASSED' "$out/gpu_tests.log")," \
        "failed $(grep -c ' FAILED' "$out/gpu_tests.log")"
      grep -E "^(FAILED|ERROR)|^E  " "$out/gpu_tests.log" | cut -c1-300 | head -20
      tail -3 "$out/gpu_tests.log";;
    bench)
      for b in ${BATCHES:-1 64}; do
        timeout "${BENCH_TIMEOUT:-45}" python3 experiments/bench_sampler.py --batch "$b" \
          --logits ${LOGITS:-lm} --methods kernel --variants ${VARIANTS:-split cluster merge} \
          --stats two_pass \
          --samplers temperature_top_p top_k20 reset_top_p \
          --out "$out/bench_sampler_b$b.json" > "$out/bench_b$b.log" 2>&1
        rc=$?
        echo "bench B=$b exit $rc"; grep -E "Error|error" "$out/bench_b$b.log" | tail -3
      done;;
    table)
      python3 - "$out" <<'EOF'
import glob, json, sys
rows, cols = {}, []
for path in sorted(glob.glob(f"{sys.argv[1]}/bench_sampler_b*.json")):
    for r in json.load(open(path))["results"]:
        for k, v in r.items():
            if k.endswith("_over_greedy_us"):
                name, label = k[: -len("_over_greedy_us")].split("/")
                rows.setdefault(name, {})[(r["batch"], label)] = v
                rows.setdefault("(greedy us)", {})[(r["batch"], label)] = r["greedy_us"]
                cols += [(r["batch"], label)] if (r["batch"], label) not in cols else []
print("us over greedy; targets 15 at B=1, 60 at B=64 (kernel = the default, "auto")")
print(f"{'sampler':>18} " + " ".join(f"{f'B={b} {m}':>18}" for b, m in cols))
for name, v in rows.items():
    print(f"{name:>18} " + " ".join(f"{v.get(c, float('nan')):>18.1f}" for c in cols))
EOF
      ;;
    *) echo "unknown phase $phase";;
  esac
  echo "[phase $phase: $(( $(date +%s) - t0 )) s]"
done
