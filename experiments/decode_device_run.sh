#!/usr/bin/env bash
# Device phases for the stacked / fused decoder ([T2-A]) and its comparisons on the H200.
# Usage: experiments/decode_device_run.sh OUTDIR [phases]
#   env      versions and GPU
#   gputest  the gpu-marked tests of GPU_TESTS (default tests/test_kernels_gpu.py); GPUTEST_JOBS
#            (default 1) runs their ids in that many concurrent shards (GPUTEST_TIMEOUT each)
#   hlo      optimized-HLO report of the decode step (2 and 36 layers, bf16 and NVFP4)
#   ab8      8-layer decode, this tree vs the baseline tree in .base/ (BASE), same GPU, one call
#   abflags  this tree with XLA_FLAGS variants FLAGS_A / FLAGS_B (e.g. dynamic-slice fusion)
#   cold36   36-layer NVFP4 batch 1: first-call (compile + run) times with an empty JAX cache,
#            then again in a second process from the persistent cache
#   gemm     bf16 decode GEMMs fused vs split (qkv, gate_up), batch 1..64
#   batch    8-layer decode at batch 16 and 64, bf16 vs NVFP4 (BATCH_ARGS)
#   attn     decode-attention benchmark and its gpu tests (tests/test_decode_attention.py)
#   fused    8-layer NVFP4 fused vs unfused linears (FUSED_ARGS), then the fused-linear gpu tests
#   fused36  36-layer bf16 / NVFP4 batch-1 speedup with the breakdown (FUSED36_ARGS)
#   sampler  sampler micro-benchmark (SAMPLER_MICRO_ARGS), then 36-layer decode loops per sampler
#            (SAMPLER_ARGS; SAMPLER_LOOP=0 skips them)
#   train    Countdown search reasoners ([T2-F]), the runs of TRAIN_RUNS ("TAG SIZE [args]" per
#            line; default sizes s and m) side by side (TRAIN_ARGS, default --time-budget 200),
#            exported to OUT/countdown_TAG; TRAIN_SIDE (default "count fusedtest", or gpu test
#            files; "" for none) runs meanwhile: things that time nothing; TRAIN_MEM is each
#            run's XLA memory fraction (default 0.3)
#   sens     NVFP4's argmax flips and KL on each trained OUT/countdown_*'s reference traces
#            (experiments/quant_sensitivity.py; a minute): the cheap proxy for the accuracy gap
#   peek     a quick BF16 / NVFP4 / ReSET accuracy look at each trained OUT/countdown_* (200
#            problems x 4, side by side), to pick the model for the full experiment
#   shard    sharded 1x1 mesh vs plain path ([T2-J]): 36-layer NVFP4 and 8-layer bf16, batch 1 and 8
#   split    linear_fusion "split" vs "unfused" ([T2-B]): the quantizer kernel's gpu tests, the
#            kernel count, then 36-layer NVFP4 decode loops (SPLIT_ARGS) for each
#   count    kernels per decoder layer of the compiled decode step (experiments/count_kernels.py)
#   profile  device-kernel timeline of the decode loop per variant (experiments/profile_step.py,
#            PROFILE_ARGS; traces kept in OUT/traces)
#   xover    GEMV vs tensor-core GEMM vs bf16 at small M, kernel alone (bench_gemm.py, XOVER_ARGS)
#   mins     36-layer NVFP4 decode at Config.gemm_min_m in MINS (default "9 2"), MIN_ARGS
#   runs     bench_decode.py once per line of RUNS ("TAG args..."), OUT/run_TAG.json (RUN_TIMEOUT)
#   verify   the gpu-marked tests of kernels written without a GPU, one pytest per VERIFY line
#            ("TAG pytest-args", default below), OUT/verify_TAG.log (VERIFY_TIMEOUT each),
#            VERIFY_JOBS of them at once
#   occ      GEMV occupancy variants, kernel alone in CUDA graphs: bench_kernel.py once per entry
#            of OCC_OPTIONS (GemvOptions fields, "" = the plan's), OCC_ARGS; then the GEMM
#            occupancy variants (bench_gemm.py, OCC_GEMM_ARGS)
#   slots    refilled slots vs static batches ([T2-L], experiments/bench_slots.py, SLOTS_ARGS)
#   long     long outputs ([T2-D], experiments/bench_decode_long.py, LONG_ARGS)
#   cbcheck  tokens under Config.command_buffer "while" vs "default" (check_command_buffer.py,
#            CB_ARGS); times nothing
#   wgmma    the wgmma (sm_90a) GEMM variant: correctness against the production GEMM and the
#            reference, then kernel-alone times (experiments/kernels/check_gemm_wgmma.py,
#            WGMMA_ARGS), OUT/wgmma.json
#   cdexp    [T2-F] the paper's experiment on the bundled Countdown reasoner
#            (experiments/search_reasoner_accuracy.py --model rejax/data/countdown, CDEXP_ARGS,
#            default --time-budget 420 --batch-rows 4096), OUT/countdown_accuracy.{json,md} and plots;
#            CDEXP_STATE (a carried OUT/countdown_accuracy_state.json of an earlier call that
#            stopped at its budget) continues that run with --resume
#   bundle   OUTDIR as one OUTDIR-name.tgz in BUNDLE_TO (the device returns few files): e.g.
#            OUTDIR=/tmp/t, phases "train sens peek bundle", BUNDLE_TO=$OUT
# Extra arguments: AB_ARGS (bench_decode.py for ab8), BASE (baseline tree, default .base).
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env gputest hlo ab8 cold36}
export PYTHONPATH=. PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
base=${BASE:-.base}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  echo "[phase $phase starts $(date -u +%H:%M:%S)]"
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
      } > "$out/env.txt" 2>&1; cat "$out/env.txt";;
    gputest)
      jobs=${GPUTEST_JOBS:-1}
      if [ "$jobs" -le 1 ]; then
        timeout ${GPUTEST_TIMEOUT:-300} python3 -m pytest -q --failures-now -m gpu ${GPU_TESTS:-tests/test_kernels_gpu.py} \
          > "$out/gpu_tests.log" 2>&1; echo "rc=$?"; tail -15 "$out/gpu_tests.log"
      else
        # GPUTEST_JOBS shards of the test ids, round robin, run at once: most of a case's time
        # is probably compiling (XLA, ptxas), CPU work that shards spread over the cores; each
        # allocates GPU memory on demand. Logs OUT/gpu_tests_J.log, exit codes OUT/gpu_tests_J.rc.
        python3 -m pytest -o addopts="" --collect-only -q -m gpu ${GPU_TESTS:-tests/test_kernels_gpu.py} \
          2>/dev/null | grep "::" > "$out/gpu_test_ids.txt"
        echo "$(wc -l < "$out/gpu_test_ids.txt") test ids in $jobs shards"
        for j in $(seq 0 $((jobs - 1))); do
          mapfile -t ids < <(awk -v j="$j" -v n="$jobs" '(NR - 1) % n == j' "$out/gpu_test_ids.txt")
          [ "${#ids[@]}" -gt 0 ] || continue
          ( export XLA_PYTHON_CLIENT_PREALLOCATE=false
            timeout ${GPUTEST_TIMEOUT:-300} python3 -m pytest -q --failures-now -m gpu "${ids[@]}" \
              > "$out/gpu_tests_$j.log" 2>&1; echo "$?" > "$out/gpu_tests_$j.rc" ) &
        done
        wait
        for j in $(seq 0 $((jobs - 1))); do
          [ -f "$out/gpu_tests_$j.rc" ] || continue
          echo "== shard $j rc=$(cat "$out/gpu_tests_$j.rc")"
          grep -E "^(FAILED|ERROR)|[0-9]+ (passed|failed|skipped)" "$out/gpu_tests_$j.log" | tail -8
          tail -c 300 "$out/gpu_tests_$j.log"; echo
        done
      fi;;
    hlo)
      timeout ${HLO_TIMEOUT:-200} python3 experiments/hlo_report.py --layers 2 36 \
        --out "$out/hlo_report.json" > "$out/hlo_report.log" 2>&1; echo "rc=$?"
      grep "^\[" "$out/hlo_report.log"; grep -v "^\[" "$out/hlo_report.log" | head -30;;
    ab8)
      args=${AB_ARGS:---layers 8 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      ( cd "$base" && JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_base timeout ${AB_TIMEOUT:-240} \
          python3 experiments/bench_decode.py $args --out "$out/ab8_base.json" \
          > "$out/ab8_base.log" 2>&1; echo "base rc=$?" )
      grep "^\[" "$out/ab8_base.log"
      JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${AB_TIMEOUT:-240} \
        python3 experiments/bench_decode.py $args --out "$out/ab8_new.json" \
        > "$out/ab8_new.log" 2>&1; echo "new rc=$?"; grep "^\[" "$out/ab8_new.log";;
    abflags)  # this tree only, with per-run XLA flags (FLAGS_A, FLAGS_B), same args as ab8
      args=${AB_ARGS:---layers 8 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      for tag in A B; do
        var=FLAGS_$tag; flags=${!var:-}
        [ -n "$flags" ] || continue
        XLA_FLAGS="$flags" JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_$tag timeout ${AB_TIMEOUT:-240} \
          python3 experiments/bench_decode.py $args ${FLAG_ARGS:-} --out "$out/ab8_flags$tag.json" \
          > "$out/ab8_flags$tag.log" 2>&1; echo "flags $tag ($flags) rc=$?"
        grep "^\[" "$out/ab8_flags$tag.log"
      done;;
    cold36)
      rm -rf /tmp/jaxcache36
      for run in cold warm; do
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache36 timeout ${COLD_TIMEOUT:-200} \
          python3 experiments/bench_decode.py --modes nvfp4 --batch 1 --gen-len 1024 \
          --repeats 3 --no-breakdown ${COLD_ARGS:-} --out "$out/cold36_$run.json" \
          > "$out/cold36_$run.log" 2>&1; echo "$run rc=$?"
        grep "compiled\|^\[" "$out/cold36_$run.log"
      done;;
    gemm)
      timeout ${GEMM_TIMEOUT:-120} python3 experiments/bench_fused_gemm.py \
        --out "$out/fused_gemm.json" > "$out/fused_gemm.log" 2>&1; echo "rc=$?"
      tail -30 "$out/fused_gemm.log";;
    batch)
      args=${BATCH_ARGS:---layers 8 --batch 16 64 --gen-len 256 --repeats 3 --no-breakdown}
      JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${BATCH_TIMEOUT:-240} \
        python3 experiments/bench_decode.py $args --out "$out/batch.json" \
        > "$out/batch.log" 2>&1; echo "rc=$?"; grep "^\[\|FAIL" "$out/batch.log";;
    attn)
      timeout ${ATTN_TIMEOUT:-200} python3 experiments/bench_attention.py \
        --out "$out/bench_attention.json" > "$out/bench_attention.log" 2>&1; echo "bench rc=$?"
      tail -40 "$out/bench_attention.log"
      timeout ${ATTN_TEST_TIMEOUT:-200} python3 -m pytest -q --failures-now -m gpu tests/test_decode_attention.py \
        > "$out/attn_tests.log" 2>&1; echo "tests rc=$?"; tail -15 "$out/attn_tests.log";;
    fused)
      args=${FUSED_ARGS:---modes nvfp4 --layers 8 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      for fu in unfused fused; do
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${FUSED_TIMEOUT:-200} \
          python3 experiments/bench_decode.py $args --linear-fusion $fu \
          --out "$out/fused8_$fu.json" > "$out/fused8_$fu.log" 2>&1; echo "$fu rc=$?"
        grep "^\[\|FAIL" "$out/fused8_$fu.log"
      done
      timeout ${FUSED_TEST_TIMEOUT:-300} python3 -m pytest -q --failures-now -m gpu tests/test_fused_linear_gpu.py \
        > "$out/fused_tests.log" 2>&1; echo "tests rc=$?"; tail -25 "$out/fused_tests.log";;
    fused36)
      args=${FUSED36_ARGS:---batch 1 --gen-len 1024 --repeats 3}
      JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${FUSED36_TIMEOUT:-300} \
        python3 experiments/bench_decode.py $args --out "$out/fused36.json" \
        > "$out/fused36.log" 2>&1; echo "36 rc=$?"; grep "^\[\|FAIL\|first" "$out/fused36.log";;
    sampler)
      timeout ${SAMPLER_TIMEOUT:-120} python3 experiments/bench_sampler.py ${SAMPLER_MICRO_ARGS:-} \
        --out "$out/bench_sampler.json" > "$out/bench_sampler.log" 2>&1; echo "micro rc=$?"
      tail -30 "$out/bench_sampler.log"
      [ "${SAMPLER_LOOP:-1}" = 0 ] && { echo "[phase $phase took $(( $(date +%s) - t0 )) s]"; continue; }
      args=${SAMPLER_ARGS:---modes nvfp4 --batch 1 64 --gen-len 256 --repeats 3 --no-breakdown}
      JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${SAMPLER_LOOP_TIMEOUT:-300} \
        python3 experiments/bench_decode.py $args \
        --samplers greedy reset reset-topk temp temp-topk topk20 \
        --out "$out/sampler_loop.json" > "$out/sampler_loop.log" 2>&1; echo "loop rc=$?"
      grep "^\[\|FAIL" "$out/sampler_loop.log";;
    train)
      # TRAIN_RUNS: one run per line, "TAG SIZE [extra train_search_reasoner.py args]";
      # default: sizes s and m at the default difficulty
      runs=${TRAIN_RUNS:-$'s s\nm m'}
      pids=(); tags=()
      while read -r tag size extra; do
        [ -n "$tag" ] || continue
        tags+=("$tag")
        XLA_PYTHON_CLIENT_MEM_FRACTION=${TRAIN_MEM:-0.3} timeout ${TRAIN_TIMEOUT:-420} \
          python3 experiments/train_search_reasoner.py --size $size --out "$out/train_$tag" \
          --export "$out/countdown_$tag" ${TRAIN_ARGS:---time-budget 200} $extra \
          > "$out/train_$tag.log" 2>&1 &
        pids+=($!)
      done <<< "$runs"
      echo "${tags[@]}" > "$out/train_tags.txt"
      if [ -n "${TRAIN_SIDE-count fusedtest}" ]; then
        for side in ${TRAIN_SIDE-count fusedtest}; do
          case $side in
            count)
              XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout ${COUNT_TIMEOUT:-200} \
                python3 experiments/count_kernels.py --layers 4 --batch 1 8 --attention einsum live \
                --out "$out/count_kernels.json" > "$out/count_kernels.log" 2>&1; echo "count rc=$?"
              tail -20 "$out/count_kernels.log";;
            fusedtest)
              XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout ${FUSED_TEST_TIMEOUT:-240} \
                python3 -m pytest -q --failures-now -m gpu tests/test_fused_linear_gpu.py \
                > "$out/fused_tests.log" 2>&1; echo "fused tests rc=$?"; tail -15 "$out/fused_tests.log";;
            *)  # a pytest target (gpu-marked tests that time nothing)
              XLA_PYTHON_CLIENT_MEM_FRACTION=0.15 timeout ${SIDE_TEST_TIMEOUT:-240} \
                python3 -m pytest -q --failures-now -m gpu $side > "$out/side_$(basename $side .py).log" 2>&1
              echo "$side rc=$?"; tail -15 "$out/side_$(basename $side .py).log";;
          esac
        done
      fi
      for pid in "${pids[@]}"; do wait $pid; echo "train rc=$?"; done
      for tag in "${tags[@]}"; do
        echo "== train $tag"; grep -v "^step\|^ *[0-9]" "$out/train_$tag.log" | tail -8
      done;;
    sens)
      for tag in $(cat "$out/train_tags.txt" 2>/dev/null || echo s m); do
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.3 timeout ${SENS_TIMEOUT:-200} \
          python3 experiments/quant_sensitivity.py --task countdown --model "$out/countdown_$tag" \
          --n-problems 500 --out "$out/sens_$tag.json" > "$out/sens_$tag.log" 2>&1
        echo "== sens $tag rc=$?"; grep -A3 '"low_entropy"\|traces_with' "$out/sens_$tag.log" | head -20
      done;;
    peek)
      pids=()
      for size in $(cat "$out/train_tags.txt" 2>/dev/null || echo s m); do
        XLA_PYTHON_CLIENT_MEM_FRACTION=0.4 timeout ${PEEK_TIMEOUT:-200} \
          python3 experiments/tiny_reasoner_accuracy.py --task countdown \
          --model "$out/countdown_$size" --n-problems 200 --n-samples 4 --n-val-problems 16 \
          --n-val-samples 2 --t-low-grid 0.3 --max-new-tokens 512 --batch-rows 1024 \
          --input-scales calibrated \
          --time-budget ${PEEK_BUDGET:-120} --out-prefix "$out/peek_$size" \
          --reset-json "$out/peek_${size}_reset.json" > "$out/peek_$size.log" 2>&1 &
        pids+=($!)
      done
      for pid in "${pids[@]}"; do wait $pid; echo "peek rc=$?"; done
      for size in $(cat "$out/train_tags.txt" 2>/dev/null || echo s m); do echo "== peek $size"; tail -12 "$out/peek_$size.log"; done;;
    shard)
      timeout ${SHARD_TIMEOUT:-200} python3 experiments/bench_sharding.py --quant nvfp4 \
        --batch 1 8 ${SHARD_ARGS:---new-tokens 128 --repeats 3 --rounds 2} \
        --out "$out/shard_1x1_nvfp4_36l.json" > "$out/shard_nvfp4.log" 2>&1; echo "nvfp4 rc=$?"
      tail -6 "$out/shard_nvfp4.log"
      timeout ${SHARD_TIMEOUT:-200} python3 experiments/bench_sharding.py --quant bf16 \
        --layers 8 --batch 1 8 ${SHARD_ARGS:---new-tokens 128 --repeats 3 --rounds 2} \
        --out "$out/shard_1x1_bf16_8l.json" > "$out/shard_bf16.log" 2>&1; echo "bf16 rc=$?"
      tail -6 "$out/shard_bf16.log";;
    split)
      timeout ${SPLIT_TEST_TIMEOUT:-200} python3 -m pytest -q --failures-now -m gpu tests/test_quant_kernel_gpu.py \
        > "$out/quant_tests.log" 2>&1; echo "tests rc=$?"; tail -15 "$out/quant_tests.log"
      timeout ${COUNT_TIMEOUT:-200} python3 experiments/count_kernels.py --layers 4 --batch 1 8 \
        --linear-fusion unfused split --attention einsum live --out "$out/count_split.json" \
        > "$out/count_split.log" 2>&1; echo "count rc=$?"; grep "^\[" "$out/count_split.log"
      args=${SPLIT_ARGS:---modes nvfp4 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      for fu in unfused split; do
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${SPLIT_TIMEOUT:-200} \
          python3 experiments/bench_decode.py $args --linear-fusion $fu \
          --out "$out/split36_$fu.json" > "$out/split36_$fu.log" 2>&1; echo "$fu rc=$?"
        grep "^\[\|FAIL\|Error" "$out/split36_$fu.log" | tail -8
      done;;
    profile)
      args=${PROFILE_ARGS:---layers 8 --variant nvfp4:1 --variant bf16:1 --variant nvfp4:8 --variant bf16:8}
      timeout ${PROFILE_TIMEOUT:-300} python3 experiments/profile_step.py $args \
        --trace-dir "$out/traces" --out "$out/profile.json" > "$out/profile.log" 2>&1
      echo "rc=$?"; grep -v "^WARNING\|^I0000\|^W0000" "$out/profile.log" | tail -60
      (cd "$out" && tar -czf traces.tgz traces && rm -rf traces);;
    xover)
      args=${XOVER_ARGS:---ms 1,2,4,8 --shapes 6144:4096,4096:4096,12288:4096,4096:12288 --ops gemm_graph,gemv_graph,jax_bf16}
      timeout ${XOVER_TIMEOUT:-200} python3 experiments/bench_gemm.py $args \
        --out "$out/xover.json" > "$out/xover.log" 2>&1; echo "rc=$?"; tail -30 "$out/xover.log";;
    mins)
      args=${MIN_ARGS:---modes nvfp4 --batch 1 8 --gen-len 256 --repeats 3 --no-breakdown}
      for mm in ${MINS:-9 2}; do
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${MIN_TIMEOUT:-200} \
          python3 experiments/bench_decode.py $args --gemm-min-m $mm \
          --out "$out/mins_$mm.json" > "$out/mins_$mm.log" 2>&1; echo "min_m=$mm rc=$?"
        grep "^\[\|FAIL\|Error" "$out/mins_$mm.log" | tail -8
      done;;
    runs)
      while read -r tag rargs; do
        [ -z "$tag" ] && continue
        JAX_COMPILATION_CACHE_DIR=/tmp/jaxcache_new timeout ${RUN_TIMEOUT:-200} \
          python3 experiments/bench_decode.py $rargs --out "$out/run_$tag.json" \
          > "$out/run_$tag.log" 2>&1; echo "$tag rc=$?"
        grep "^\[\|FAIL\|Error" "$out/run_$tag.log" | tail -8
      done <<< "${RUNS:?RUNS: lines of TAG args}";;
    verify)
      lines=${VERIFY:-$'rope tests/test_rope_cache_gpu.py
quant tests/test_quant_kernel_gpu.py
gemm tests/test_gemm_gpu.py
sampling tests/test_sampling_gpu.py
fused tests/test_fused_linear_gpu.py
flash tests/test_decode_attention_cuda_gpu.py
attn tests/test_decode_attention.py
kernels tests/test_kernels_gpu.py
probe tests/test_attention_probe.py'}
      # VERIFY_JOBS > 1 runs that many pytest processes at once (they time nothing; each takes
      # a slice of GPU memory and the compile work spreads over the CPU cores)
      jobs=${VERIFY_JOBS:-1}; vtags=()
      while read -r tag targs; do
        [ -z "$tag" ] && continue
        vtags+=("$tag")
        while [ "$(jobs -rp | wc -l)" -ge "$jobs" ]; do sleep 1; done
        ( [ "$jobs" -gt 1 ] && export XLA_PYTHON_CLIENT_PREALLOCATE=false
          timeout ${VERIFY_TIMEOUT:-240} python3 -m pytest -q --failures-now -m gpu $targs \
            > "$out/verify_$tag.log" 2>&1; echo "$?" > "$out/verify_$tag.rc" ) &
      done <<< "$lines"
      wait
      for tag in "${vtags[@]}"; do
        echo "$tag rc=$(cat "$out/verify_$tag.rc")"; tail -4 "$out/verify_$tag.log"
      done;;
    occ)
      args=${OCC_ARGS:---ms 1,2,4 --shapes 6144:4096,4096:4096,24576:4096,4096:12288 --ops nvfp4_w4a4_graph,read_floor_graph,jax_bf16 --no-chain}
      i=0
      for opts in ${OCC_OPTIONS:-base rows=2,ctas=2 rows=1,ctas=2 rows=1,ctas=3 rows=2,ctas=4,threads=256}; do
        [ "$opts" = base ] && o="" || o=$opts
        timeout ${OCC_TIMEOUT:-150} python3 experiments/bench_kernel.py $args --gemv-options "$o" \
          --out "$out/occ_$i.json" > "$out/occ_$i.log" 2>&1; echo "gemv $opts rc=$?"
        tail -8 "$out/occ_$i.log"; i=$((i + 1))
      done
      gargs=${OCC_GEMM_ARGS:---ms 8,16,32,64 --ops gemm_graph,jax_bf16 --variants gemm,gemm_wr1,gemm_sk4,gemm_sk8,gemm_wr1_sk4,gemm_wr1_sk8,gemm_cluster,gemm_cluster_wr1}
      timeout ${OCC_TIMEOUT:-200} python3 experiments/bench_gemm.py $gargs --shapes 6144:4096,4096:4096,24576:4096,4096:12288 \
        --out "$out/occ_gemm.json" > "$out/occ_gemm.log" 2>&1; echo "gemm rc=$?"; tail -20 "$out/occ_gemm.log";;
    slots)
      args=${SLOTS_ARGS:---layers 1 --sampler greedy}
      timeout ${SLOTS_TIMEOUT:-300} python3 experiments/bench_slots.py $args \
        --out "$out/slots.json" > "$out/slots.log" 2>&1; echo "rc=$?"; tail -30 "$out/slots.log";;
    long)
      args=${LONG_ARGS:---quick}
      timeout ${LONG_TIMEOUT:-300} python3 experiments/bench_decode_long.py $args \
        --out "$out/long.json" > "$out/long.log" 2>&1; echo "rc=$?"; tail -40 "$out/long.log";;
    cbcheck)
      timeout ${CB_TIMEOUT:-300} python3 experiments/check_command_buffer.py ${CB_ARGS:---layers 2} \
        --out "$out/cbcheck.json" > "$out/cbcheck.log" 2>&1; echo "rc=$?"; tail -12 "$out/cbcheck.log";;
    wgmma)
      timeout ${WGMMA_TIMEOUT:-170} python3 experiments/kernels/check_gemm_wgmma.py \
        --out "$out/wgmma.json" ${WGMMA_ARGS:-} > "$out/wgmma.log" 2>&1
      echo "wgmma rc=$?"; tail -30 "$out/wgmma.log";;
    cdexp)
      mkdir -p "$out/cdexp_model"
      cp rejax/data/countdown/* "$out/cdexp_model/"  # reset.json is written beside the weights
      resume=()
      if [ -n "${CDEXP_STATE:-}" ]; then  # an earlier call's state: go on from its chunks
        cp "$CDEXP_STATE" "$out/countdown_accuracy_state.json"; resume=(--resume)
      fi
      timeout ${CDEXP_TIMEOUT:-560} python3 experiments/search_reasoner_accuracy.py \
        --model "$out/cdexp_model" --out-prefix "$out/countdown_accuracy" "${resume[@]}" \
        ${CDEXP_ARGS:---time-budget 420 --batch-rows 4096} \
        > "$out/cdexp.log" 2>&1
      echo "cdexp rc=$?"; tail -40 "$out/cdexp.log";;
    bundle)
      # BUNDLE_TO (a folder, e.g. $OUT) gets OUTDIR as one gzipped tar (the device returns at
      # most 8 files, two folders deep): checkpoints, logs and JSON of the phases before it
      to=${BUNDLE_TO:?BUNDLE_TO: the folder that gets the tar}
      mkdir -p "$to"
      tar czf "$to/$(basename "$out").tgz" -C "$(dirname "$out")" "$(basename "$out")"
      echo "bundled $(du -sh "$to/$(basename "$out").tgz" | cut -f1)";;
    count)
      timeout ${COUNT_TIMEOUT:-200} python3 experiments/count_kernels.py --layers 4 --batch 1 8 \
        --attention einsum live --out "$out/count_kernels.json" > "$out/count_kernels.log" 2>&1
      echo "rc=$?"; tail -20 "$out/count_kernels.log";;
  esac
  echo "[phase $phase took $(( $(date +%s) - t0 )) s]"
done
