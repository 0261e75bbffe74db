#!/usr/bin/env bash
# One device session for the NVFP4 W4A4 tensor-core GEMM: environment, ptxas resource report,
# GPU tests, benchmark, compute-sanitizer. Usage: experiments/gemm_device_run.sh OUTDIR [phases]
# phases (default: env ptxas pytest bench); also: sanitize, ncu (the GEMM's limiter at M = 64:
# NCU_MS, NCU_SHAPES, NCU_LAUNCHES), xor (the repacked-decode / static-copy variants of
# experiments/kernels/nvfp4_gemm_xor.py: bitwise against production, timed; XOR_ARGS) and
# xor_ncu (executed instructions and issue activity, production vs XOR_NCU_VARIANT), profile
# (experiments/profile_step.py: every kernel of an 8-layer decode step, NVFP4 and bf16 at
# PROFILE_BATCHES, default "64 16", or PROFILE_VARIANTS, profile_step.py's --variant values: where the NVFP4 step spends its time beside the GEMMs) and
# chain (Config.gemm_chain's finish-quantizers: its kernels alone against the launches they
# replace, GPU tests), chain_count, chain_sanitize, and chain_decode (36-layer decode of
# CHAIN_VARIANTS, default "split swiglu_rope cluster", at CHAIN_BATCHES, an 8-layer profile of
# the three at batch 64); chain and chain_decode one call each (each under 10 minutes);
# fill16 (GemmOptions.occupancy "fill16" at batch 8: GPU test, decode against "fill", profile;
# one call); wgmma_large (the wgmma experiment's 128 / 256-token tiles at M = 256 / 512: bits
# and times; one call), wgmma_prefill (those tiles on prefill's linears against today's
# dequantize-then-dot path and bf16), wgmma_e2e (Config.gemm_wgmma_min_m: GPU tests, the
# 36-layer prefill at batch 1 / 8 with and without it, bf16); prefill_paths (the three
# prefill paths end to end, the GEMM against the dot at M = 1024 / 2048); dequant (the dot
# path's dequantizer kernel: GPU tests, per linear, 36-layer prefill); accept_kernel and accept_decode ([T2-C]'s acceptance table and
# end-to-end rows; one call each); wgmma_each (each wgmma variant's check in its own process,
# launches blocking); prefill_profile (profile_step.py --phase prefill, 8 layers); quant_rows
# (the quantizer's GPU tests with its one-CTA-a-row path); wgmma_bulk (the BULK wgmma kernels:
# bits, times against WGMMA_BASE, stall reasons; knobs in the phase; e.g. PIPE 2 against the
# model's: WGMMA_BULK_VARIANTS=wgmma_n128_xb_p2 WGMMA_BASE=wgmma_n128_xb WGMMA_MS=256,512
# NCU_SKIP=1 BULK_TAG=p2); wgmma_ncu (the model's wgmma GEMM under Nsight Compute at 512
# rows: tensor-pipe utilisation and stalls); dot_x (the dot path's activations behind an
# optimization barrier, or written by the quantizer kernel, against fused into XLA's GEMM;
# batch-8 prefill); rows_inner (experiments/kernels/quant_tiles_rows_inner.patch in a copy of
# the tree: tiles GPU tests, bench_quant_tiles.py against this tree); wgmma_xquant (the
# quantizer's stage-tile form in front of the wgmma GEMM: GPU tests, 36-layer prefill);
# pending_quant, pending_paths (the GPU tests that the last kernel changes have not met;
# pending_parallel: them as concurrent processes);
# dot_finish (Config.gemm_dot_finish "swiglu" / "block" against "split": GPU tests, batch-8
# prefill, profile); stream_overlap (experiments/stream_overlap_probe.py); dot_stream
# (Config.gemm_dot_stream "side" against "main": GPU test, batch-8 prefill; DS_ARGS);
# prefill_ab (one bench process: bf16 and every gemm_dot_stream x gemm_dot_finish);
# tiles_chunk (the x_hat tiles quantizer with whole-row chunks: GPU test, candidates timed);
# wgmma_ws (applies experiments/kernels/wgmma_ws.patch, the warp-specialized wgmma GEMM that
# lost: bits, then kernel alone at 512 and 4096 rows);
# dot_sanitize (compute-sanitizer on the dot finish's forms); wgmma_4096 (the batch-8 prefill's
# rows on the wgmma GEMM against the dot path: kernel alone, then 36 layers).
# Knobs: BENCH_ARGS, PYTEST_K, QUANT_K (quant_rows' -k), WGMMA_TIME_BUDGET.
# GIT_SHA: the commit of the tree, recorded as versions' git_sha_declared in every JSON (the
# device's copy of the tree may carry an older git HEAD).
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env ptxas pytest bench}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv
        python3 -c "import jax, torch; from cuda_ops.build import nvrtc_version; \
print('jax', jax.__version__, 'torch', torch.__version__, 'nvrtc', nvrtc_version(), jax.devices())"
      } > "$out/env.txt" 2>&1; cat "$out/env.txt";;
    ptxas)
      # registers / spills / SASS mix of the GEMM at the plan's tile configs
      for cfg in "16 16 2 4 128 4 8" "64 64 2 4 128 3 1" "64 64 2 4 256 3 1" "32 32 1 4 128 4 4"; do
        set -- $cfg
        echo "== M=$1 TM=$2 WR=$3 NWARPS=$4 KT=$5 STAGES=$6 SPLITK=$7 (N=K=4096)"
        nvcc -arch=sm_90 -cubin -o /tmp/g.cubin -Xptxas -v -DM_TOK=$1 -DN_OUT=4096 -DK_IN=4096 \
          -DTM=$2 -DWR=$3 -DNWARPS=$4 -DKT=$5 -DSTAGES=$6 -DSPLITK=$7 cuda_ops/nvfp4_gemm.cu 2>&1 \
          | grep -E "registers|spill|error"
        cuobjdump -sass /tmp/g.cubin > /tmp/g.sass 2>&1
        for op in HMMA HMUL2 LDS.128 LDGSTS LOP3 SHF STL LDL; do
          printf "%s %s  " "$op" "$(grep -c "$op" /tmp/g.sass)"; done; echo
      done > "$out/ptxas.txt" 2>&1; cat "$out/ptxas.txt";;
    pytest)
      timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -q -rs -m gpu tests/test_gemm_gpu.py \
        ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider > "$out/pytest.log" 2>&1
      grep -E "^E  .*(rel err|unwritten|repeat|Error)" "$out/pytest.log" | cut -c1-400 | head -20
      tail -15 "$out/pytest.log";;
    bench)
      timeout ${BENCH_TIMEOUT:-300} python3 experiments/bench_gemm.py ${BENCH_ARGS:-} \
        --out "$out/bench_kernel_gemm.json" > "$out/bench.log" 2>&1; tail -75 "$out/bench.log";;
    sanitize)
      for tool in memcheck racecheck; do
        timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool python3 -m pytest -q -m gpu \
          tests/test_gemm_gpu.py -k sanitizer -p no:cacheprovider 2>&1 | tail -8
      done > "$out/sanitize.txt" 2>&1; cat "$out/sanitize.txt";;
    ncu)
      # Where the production GEMM's time goes at M = 64 ([T2-C]): Nsight Compute on its launches
      # in bench_gemm.py's CUDA graph (NCU_SHAPES, NCU_MS), the main kernel and the split-K
      # finish; full sections in OUT/ncu_gemm_full.txt, the limiter lines in OUT/ncu_gemm.txt
      timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k regex:nvfp4_gemm --launch-count ${NCU_LAUNCHES:-4} \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis \
        --section Occupancy --section LaunchStats --section SchedulerStats --section WarpStateStats \
        --section InstructionStats \
        python3 experiments/bench_gemm.py --ms ${NCU_MS:-64} --shapes ${NCU_SHAPES:-24576:4096,4096:12288} \
        --ops gemm_graph --variants gemm --out "$out/ncu_bench.json" > "$out/ncu_gemm_full.txt" 2>&1; echo "ncu rc=$?"
      grep -E "nvfp4_gemm|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Executed Ipc|Issue Slots|Achieved Occupancy|Registers|Theoretical Occ|Block Limit|No Eligible|Eligible Warps|Active Warps|Warp Cycles|Stall|Pipe|est\. " \
        "$out/ncu_gemm_full.txt" | head -160 | tee "$out/ncu_gemm.txt";;
    xor)
      timeout ${XOR_TIMEOUT:-420} python3 experiments/kernels/check_gemm_xor.py \
        --out "$out/gemm_xor.json" ${XOR_ARGS:-} > "$out/gemm_xor.log" 2>&1; echo "check rc=$?"
      grep -E "FAILED|Error|equal" "$out/gemm_xor.log" | grep -v '": 1.0' | head -20
      tail -30 "$out/gemm_xor.log";;
    xor_ncu)
      # one process per kernel, so each profile holds only that kernel's launches
      for name in production ${XOR_NCU_VARIANT:-xor_static}; do
        timeout ${NCU_TIMEOUT:-240} ncu --clock-control none -k regex:nvfp4_gemm_w4a4 \
          --launch-count ${NCU_LAUNCHES:-4} --section SpeedOfLight --section SchedulerStats \
          --section WarpStateStats --section InstructionStats --section Occupancy \
          python3 experiments/kernels/check_gemm_xor.py --no-check --no-extra --no-bf16 \
          --shapes ${NCU_SHAPES:-24576:4096} --ms ${NCU_MS:-64} --time-only $name \
          --variants ${XOR_NCU_VARIANT:-xor_static} --out "$out/xor_ncu_$name.json" \
          > "$out/xor_ncu_$name.txt" 2>&1; echo "ncu $name rc=$?"
        grep -E "Duration|Executed Instructions |Issue Slots Busy|Executed Ipc A|Eligible Warps|No Eligible|Achieved Occupancy|Registers Per|Warp Cycles Per Issued" \
          "$out/xor_ncu_$name.txt" | head -40
      done;;
    chain)
      # Config.gemm_chain (rejax/ops/fused_block.py): the fused launches against the ones they
      # replace, kernel alone (check_finish_quant.py: every chunking, clusters included), then
      # its GPU tests (about 6 minutes on an H100: most of a call); chain_count and
      # chain_sanitize: the kernels a layer launches, compute-sanitizer on its kernels;
      # chain_decode: the 36-layer decode at CHAIN_BATCHES of CHAIN_VARIANTS in one process
      # (and bf16), then an 8-layer profile at batch 64
      timeout ${CHECK_TIMEOUT:-180} python3 experiments/kernels/check_finish_quant.py \
        --out "$out/finish_quant.json" > "$out/finish_quant.log" 2>&1; echo "check rc=$?"
      grep -E "FAILED|passed" "$out/finish_quant.log"
      python3 - "$out/finish_quant.json" <<'PY'
import json, sys
for r in json.load(open(sys.argv[1]))["rows"]:
    print(r["pair"], "M", r["m"], "S", r["splitk"],
          {k: round(v, 2) for k, v in r.items() if k.endswith(("_us", "_speedup"))},
          {k: v for k, v in r.items() if k.endswith("_equal") and not v})
PY
      timeout ${PYTEST_TIMEOUT:-420} python3 -m pytest -q -rs -m gpu tests/test_fused_block_gpu.py \
        ${PYTEST_K:+-k "$PYTEST_K"} -p no:cacheprovider > "$out/chain_pytest.log" 2>&1
      tail -6 "$out/chain_pytest.log";;
    chain_count)
      # kernels a layer launches, from the compiled step (4 layers, "live" attention)
      timeout ${COUNT_TIMEOUT:-150} python3 experiments/count_kernels.py --layers 4 \
        --batch 16 64 --linear-fusion split --attention live \
        --gemm-chain split swiglu_rope fused cluster \
        --out "$out/count_chain.json" 2>&1 | grep -E "launches per layer" | cut -c1-160;;
    chain_sanitize)
      for tool in memcheck racecheck; do
        timeout ${SAN_TIMEOUT:-200} compute-sanitizer --tool $tool python3 -m pytest -q -m gpu \
          tests/test_fused_block_gpu.py -k sanitizer -p no:cacheprovider 2>&1 | tail -4
      done > "$out/chain_sanitize.txt" 2>&1; cat "$out/chain_sanitize.txt";;
    chain_decode)
      timeout ${BENCH_TIMEOUT:-420} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch ${CHAIN_BATCHES:-16 64} --gen-len 512 --repeats 3 --no-breakdown \
        --gemm-chain ${CHAIN_VARIANTS:-split swiglu_rope cluster} --out "$out/decode_chain.json" \
        > "$out/decode_chain.log" 2>&1
      grep -E "ms/token|FAILED" "$out/decode_chain.log"
      timeout ${PROFILE_TIMEOUT:-150} python3 experiments/profile_step.py --layers 8 --steps 16 \
        --variant nvfp4:64:gemm_chain=split --variant nvfp4:64:gemm_chain=swiglu_rope \
        --variant nvfp4:64:gemm_chain=cluster --out "$out/profile_chain.json" \
        > "$out/profile_chain.log" 2>&1; grep -E "^\[|/layer" "$out/profile_chain.log" | head -30;;
    fill16)
      # GemmOptions.occupancy "fill16" (batch 8 in the 16-token tile of batch 16): its GPU test,
      # the 36-layer decode at FILL16_BATCHES (default 8) against "fill" and bf16 in one process,
      # then the 8-layer profile of both at batch 8 (and "fill" at 16: the GEMM a launch)
      timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -q -rs -m gpu tests/test_gemm_gpu.py \
        -k fill16 -p no:cacheprovider > "$out/fill16_pytest.log" 2>&1
      tail -3 "$out/fill16_pytest.log"
      timeout ${BENCH_TIMEOUT:-260} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch ${FILL16_BATCHES:-8} --gen-len 1024 --repeats 3 --no-breakdown \
        --gemm-occupancy fill fill16 --out "$out/decode_fill16.json" > "$out/decode_fill16.log" 2>&1
      grep -E "ms/token|FAILED" "$out/decode_fill16.log"
      timeout ${PROFILE_TIMEOUT:-120} python3 experiments/profile_step.py --layers 8 --steps 16 \
        --variant nvfp4:8 --variant nvfp4:8:gemm_occupancy=fill16 --variant nvfp4:16 \
        --out "$out/profile_fill16.json" > "$out/profile_fill16.log" 2>&1
      grep -E "^\[|nvfp4_gemm " "$out/profile_fill16.log" | head -12;;
    wgmma_large)
      # the wgmma GEMM's 128 / 256-token tiles (cuda_ops/nvfp4_gemm_wgmma.cu, each
      # weight decoded once per tile) at M = 256 (the kernel table's) and 512 (a 512-token
      # prefill): bits against production and float64, then timed with production and bf16
      timeout ${BENCH_TIMEOUT:-400} python3 experiments/kernels/check_gemm_wgmma.py \
        --ms ${WGMMA_MS:-256,512} --variants ${WGMMA_VARIANTS:-wgmma_n128,wgmma_n128_wr2,wgmma_n128_g4,wgmma_n128_wr2_g4} \
        --time-budget ${WGMMA_TIME_BUDGET:-300} --out "$out/wgmma_large.json" > "$out/wgmma_large.log" 2>&1
      echo "wgmma_large rc=$?"; grep -v '^{' "$out/wgmma_large.log" | tail -40;;
    wgmma_prefill)
      # prefill's linears (Qwen3-8B, 512 tokens at batch 1 / 8): the wgmma large tiles against
      # what prefill runs now above 256 rows (old_path: every weight dequantized to bf16, then
      # one bf16 dot) and jitted bf16
      timeout ${BENCH_TIMEOUT:-400} python3 experiments/bench_gemm.py --ms 512,4096 \
        --shapes 6144:4096,4096:4096,24576:4096,4096:12288 --variants wgmma_n128,wgmma_n256 \
        --ops gemm_graph,jax_bf16,old_path --old-ms 512,4096 --time-budget 330 \
        --out "$out/wgmma_prefill.json" > "$out/wgmma_prefill.log" 2>&1; echo "bench rc=$?"
      grep -E "geomean|x6144|x4096|x12288" "$out/wgmma_prefill.log" | head -30;;
    wgmma_e2e)
      # GemmOptions.wgmma_min_m in the model: its GPU tests, then the 36-layer prefill (prompt
      # 512, batch 1 / 8; 32 new tokens, so the prefill dominates) with the wgmma GEMM from 128
      # rows against the dot path and bf16, one process
      timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -rs -m gpu tests/test_gemm_gpu.py \
        -k wgmma -p no:cacheprovider > "$out/wgmma_pytest.log" 2>&1
      tail -3 "$out/wgmma_pytest.log"
      timeout ${BENCH_TIMEOUT:-300} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch 1 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-wgmma-min-m none 128 \
        --out "$out/decode_wgmma.json" > "$out/decode_wgmma.log" 2>&1
      grep -E "prefill|FAILED" "$out/decode_wgmma.log" | head -20;;
    prefill_paths)
      # prefill's three W4A4 paths end to end (36 layers, prompt 512, 32 new tokens, batch 1 /
      # 8): the default (dot above 256 rows), the wgmma GEMM from 128 rows, and the mma.sync
      # GEMM up to 512 rows (--gemm-max-m 512, batch 1 only), bf16 beside; then the kernel
      # alone at M = 1024 / 2048 against the dot (where the GEMM's range should end)
      timeout ${PYTEST_TIMEOUT:-120} python3 -m pytest -q -rs -m gpu tests/test_gemm_gpu.py \
        -k wgmma -p no:cacheprovider > "$out/wgmma_pytest.log" 2>&1
      tail -3 "$out/wgmma_pytest.log"
      timeout ${BENCH_TIMEOUT:-200} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch 1 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-wgmma-min-m none 128 \
        --out "$out/decode_wgmma.json" > "$out/decode_wgmma.log" 2>&1
      timeout ${BENCH_TIMEOUT:-120} python3 experiments/bench_decode.py --modes nvfp4 \
        --batch 1 --gen-len 32 --repeats 3 --no-breakdown --gemm-max-m 512 \
        --out "$out/decode_max512.json" > "$out/decode_max512.log" 2>&1
      grep -hE "prefill|FAILED|Error" "$out/decode_wgmma.log" "$out/decode_max512.log" | head -20
      timeout ${GEMM_TIMEOUT:-150} python3 experiments/bench_gemm.py --ms 1024,2048 \
        --shapes 6144:4096,4096:4096,24576:4096,4096:12288 --variants gemm,wgmma_n128_wr2 \
        --ops gemm_graph,jax_bf16,old_path --old-ms 1024,2048 --time-budget 120 \
        --out "$out/prefill_gemm.json" > "$out/prefill_gemm.log" 2>&1; echo "bench rc=$?"
      grep -E "geomean" "$out/prefill_gemm.log" | head -20;;
    dequant)
      # the dot path's weight dequantizer (GemmOptions.dot_dequant "kernel"): its GPU tests,
      # then per linear at M = 512 / 4096 against XLA's decode and bf16, then the 36-layer
      # prefill (prompt 512, batch 1 / 8) with each, bf16 beside, one process
      timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -q -rs -m gpu tests/test_dequant_gpu.py \
        -p no:cacheprovider > "$out/dequant_pytest.log" 2>&1
      tail -3 "$out/dequant_pytest.log"
      timeout ${GEMM_TIMEOUT:-150} python3 experiments/bench_gemm.py --ms 512,4096 \
        --shapes 6144:4096,4096:4096,24576:4096,4096:12288 --variants gemm \
        --ops jax_bf16,old_path,dot_kernel --old-ms 512,4096 --time-budget 130 \
        --out "$out/dequant_gemm.json" > "$out/dequant_gemm.log" 2>&1; echo "bench rc=$?"
      grep -E "geomean" "$out/dequant_gemm.log" | head -12
      timeout ${BENCH_TIMEOUT:-220} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch 1 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-dot-dequant xla kernel \
        --out "$out/decode_dequant.json" > "$out/decode_dequant.log" 2>&1
      grep -E "prefill|FAILED|Error" "$out/decode_dequant.log" | head -12;;
    wgmma_each)
      # each WGMMA_VARIANTS in a process of its own with CUDA_LAUNCH_BLOCKING (which one faults,
      # if one does), correctness only at WGMMA_MS (default 256)
      for v in ${WGMMA_VARIANTS:-wgmma_n128 wgmma_n128_g4 wgmma_n128_wr2_g4}; do
        CUDA_LAUNCH_BLOCKING=1 timeout ${EACH_TIMEOUT:-70} python3 \
          experiments/kernels/check_gemm_wgmma.py --ms ${WGMMA_MS:-256} --variants $v --no-time \
          --out "$out/each_$v.json" > "$out/each_$v.log" 2>&1
        echo "$v rc=$?"
        grep -E "^\{|FAILED|Error|error:|^  \(" "$out/each_$v.log" | grep -v "cuda_event\|allocator" \
          | cut -c1-300 | head -8
      done;;
    wgmma_bulk)
      # the BULK wgmma kernels (stage copies on mbarriers; WGMMA_BULK_VARIANTS):
      # 1. their bits at BITS_MS (256) in one process, launches blocking (a fault stops there);
      # 2. timed at WGMMA_MS (256,512) beside WGMMA_BASE (wgmma_n128_wr2) and production, bf16;
      # 3. unless NCU_SKIP=1, Nsight Compute stall reasons of NCU_VARIANTS (wgmma_n128_wr2 and
      #    wgmma_n128_wr2_bulk; 6144 x 4096, M = 256: the first wgmma launches, two each)
      bulk=${WGMMA_BULK_VARIANTS:-wgmma_n128_wr2_bulk wgmma_n128_bulk wgmma_n128_wr2_g4_bulk}
      tag=${BULK_TAG:-bulk}
      CUDA_LAUNCH_BLOCKING=1 timeout ${EACH_TIMEOUT:-120} python3 \
        experiments/kernels/check_gemm_wgmma.py --ms ${BITS_MS:-256} --variants ${bulk// /,} \
        --no-time --out "$out/${tag}_bits.json" > "$out/${tag}_bits.log" 2>&1
      echo "bits rc=$?"
      grep -E "FAILED|Error|error:|^  \(|passed|^\{" "$out/${tag}_bits.log" | cut -c1-400 | head -16
      timeout ${BENCH_TIMEOUT:-300} python3 experiments/kernels/check_gemm_wgmma.py \
        --ms ${WGMMA_MS:-256,512} --variants ${WGMMA_BASE:-wgmma_n128_wr2},${bulk// /,} \
        --time-budget ${WGMMA_TIME_BUDGET:-240} --out "$out/${tag}_time.json" > "$out/${tag}_time.log" 2>&1
      echo "timed rc=$?"; grep -v '^{' "$out/${tag}_time.log" | tail -40
      if [ "${NCU_SKIP:-0}" != 1 ]; then
        timeout ${NCU_TIMEOUT:-150} ncu --clock-control none -k regex:wgmma --launch-count 4 \
          --section WarpStateStats --section SchedulerStats --section SpeedOfLight \
          --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
          python3 experiments/kernels/check_gemm_wgmma.py --ms 256 --no-time \
          --variants ${NCU_VARIANTS:-wgmma_n128_wr2,wgmma_n128_wr2_bulk} --out "$out/${tag}_ncu.json" \
          > "$out/${tag}_ncu.txt" 2>&1; echo "ncu rc=$?"
        grep -E "nvfp4_gemm_w4a4_wgmma|Duration|stalled_(long|lg|barrier|short|dispatch|wait|gmma|math|mio|not_sel|selected)|Eligible Warps|Issued Warp|Warp Cycles Per Issued" \
          "$out/${tag}_ncu.txt" | head -90
      fi;;
    wgmma_ncu)
      # where the model's wgmma GEMM spends its time at NCU_M (512) rows, the four Qwen3-8B
      # shapes (NCU_VARIANTS, default wgmma_n128_xb): the metric names ncu knows for the
      # tensor pipes first (gmma), then SpeedOfLight, ComputeWorkloadAnalysis (pipe
      # utilisation) and the stall reasons. (A run that added MemoryWorkloadAnalysis crashed
      # after profiling, rc 139, in the fortieth session.)
      ncu --query-metrics 2>/dev/null | grep -iE "gmma|pipe_tensor" > "$out/ncu_metric_names.txt"
      head -20 "$out/ncu_metric_names.txt"
      timeout ${NCU_TIMEOUT:-200} ncu --clock-control none -k regex:wgmma --launch-count 4 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section WarpStateStats \
        --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio" \
        python3 experiments/kernels/check_gemm_wgmma.py --ms ${NCU_M:-512} --no-time \
        --variants ${NCU_VARIANTS:-wgmma_n128_xb} --out "$out/ncu_m.json" > "$out/ncu_m.txt" 2>&1
      echo "ncu rc=$?"
      grep -E "nvfp4_gemm_w4a4_wgmma|Duration|Throughput|Pipe|Issue Slots|Executed Ipc|stalled_(long|wait|gmma|math|barrier|selected)" \
        "$out/ncu_m.txt" | head -80;;
    dot_x)
      # the dot path's activation operand (4096-row prefill: batch 8): Config.gemm_dot_x
      # "fused" (the default) against "materialized" (an optimization barrier in front of the
      # dot, so that XLA runs it as cuBLAS, not as a GEMM fusion that decodes x per tile) and
      # "kernel" (the quantizer kernel's bf16 form writes the operand): the GPU test first,
      # then 36 layers at batch 8 (bf16 beside the first), then the 8-layer profile
      timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -rA -m gpu tests/test_dequant_gpu.py \
        -k dot_x -p no:cacheprovider > "$out/dot_x_pytest.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/dot_x_pytest.log" | tail -5
      for dx in materialized kernel fused; do
        modes="nvfp4"; [ $dx = materialized ] && modes="nvfp4 bf16"
        timeout ${BENCH_TIMEOUT:-200} python3 experiments/bench_decode.py --modes $modes \
          --batch 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-dot-x $dx \
          --out "$out/decode_dx_$dx.json" > "$out/decode_dx_$dx.log" 2>&1
        echo "$dx rc=$?"; grep -E "ms/token|FAILED|Error" "$out/decode_dx_$dx.log"
      done
      timeout ${PROFILE_TIMEOUT:-200} python3 experiments/profile_step.py --phase prefill \
        --layers 8 --steps 2 --variant nvfp4:8 --variant nvfp4:8:gemm_dot_x=materialized \
        --variant nvfp4:8:gemm_dot_x=kernel --variant bf16:8 --out "$out/prefill_profile_dx.json" > "$out/prefill_profile_dx.log" 2>&1
      echo "profile rc=$?"; grep -E "^\[|cublas|xla_fusion|nvfp4_" "$out/prefill_profile_dx.log" | head -24;;
    wgmma_xquant)
      # the quantizer kernel's "xhat_tiles" form in front of the wgmma GEMM
      # (Config.gemm_wgmma_x_quant "kernel", opt-in): its GPU tests and the tiny model's
      # generation test on the default wgmma range, then the 36-layer prefill (prompt 512,
      # batch 1 / 8) with "kernel" and with "xla" (the default), bf16 beside the first
      timeout ${PYTEST_TIMEOUT:-200} python3 -m pytest -rA -m gpu tests/test_quant_kernel_gpu.py \
        -k "tiles" -p no:cacheprovider > "$out/xquant_pytest.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/xquant_pytest.log" | tail -8
      timeout ${TINY_TIMEOUT:-240} python3 -m pytest -rA -m gpu tests/test_fused_linear_gpu.py \
        -k tiny_model -p no:cacheprovider > "$out/tiny_pytest.log" 2>&1
      echo "tiny rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tiny_pytest.log" | tail -8
      for xq in kernel xla; do
        modes="nvfp4"; [ $xq = kernel ] && modes="nvfp4 bf16"
        timeout ${BENCH_TIMEOUT:-200} python3 experiments/bench_decode.py --modes $modes \
          --batch 1 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-wgmma-x-quant $xq \
          --out "$out/decode_xq_$xq.json" > "$out/decode_xq_$xq.log" 2>&1
        echo "$xq rc=$?"; grep -E "ms/token|FAILED|Error" "$out/decode_xq_$xq.log"
      done;;
    pending_quant|pending_paths)
      # the GPU tests the one-add E2M1 rounding and the finish-quantizer's launch bounds have
      # not met yet, in two calls (each about 5 minutes): pending_quant the quantizer kernel
      # (all forms) and the fused GEMV's in-kernel quantization; pending_paths the dot path's
      # activations, the finish-quantizers and rejax.ops.dot_block
      if [ $phase = pending_quant ]; then
        tests="tests/test_quant_kernel_gpu.py
          tests/test_fused_linear_gpu.py::test_in_kernel_quantization_equals_quantize_activation"
      else
        tests="tests/test_dequant_gpu.py tests/test_fused_block_gpu.py tests/test_dot_block_gpu.py"
      fi
      timeout ${PYTEST_TIMEOUT:-540} python3 -m pytest -rA -m gpu -p no:cacheprovider $tests \
        -k "not sanitizer" > "$out/${phase}_pytest.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/${phase}_pytest.log" | tail -12;;
    pending_parallel)
      # the pending GPU tests as concurrent pytest processes (their time is mostly NVRTC and
      # XLA compiles on the host's cores): the quantizer forms the one-add E2M1 rounding has not
      # met, the fused GEMV's in-kernel quantization and the tiny model, the finish-quantizers
      # (FIN_CACHE launch bounds), rejax.ops.dot_block and the dequantizer
      # (PAR_GROUPS: the groups to run, default all six)
      run_group() {  # name dir pytest-args...
        local name=$1 dir=$2; shift 2
        case " ${PAR_GROUPS:-tiles quant gemv tiny finish dot} " in *" $name "*) ;; *) return;; esac
        (cd $dir && timeout ${PYTEST_TIMEOUT:-540} python3 -m pytest -rA -m gpu \
          -p no:cacheprovider "$@") > "$out/par_$name.log" 2>&1
        echo "$name rc=$?" >> "$out/par_rc.txt"
      }
      : > "$out/par_rc.txt"
      run_group tiles . tests/test_quant_kernel_gpu.py -k "xhat_tiles or wgmma_on" &
      run_group quant . tests/test_quant_kernel_gpu.py \
        -k "not equals_quantize_activation and not xhat_tiles and not wgmma_on" &
      run_group gemv . tests/test_fused_linear_gpu.py \
        -k "in_kernel_quantization or swiglu_epilogue or norm_out_tail" &
      tiny=tests/test_fused_linear_gpu.py::test_tiny_model_greedy_tokens_gpu_kernels_vs_cpu_reference
      run_group tiny . "$tiny[fused-b4]" "$tiny[split+epilogues-b8]" &
      run_group finish . tests/test_fused_block_gpu.py -k "not sanitizer" &
      run_group dot . tests/test_dot_block_gpu.py tests/test_dequant_gpu.py &
      wait; cat "$out/par_rc.txt"
      for f in "$out"/par_*.log; do
        echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed" "$f" | tail -8; done;;
    dot_finish)
      # Config.gemm_dot_finish (rejax.ops.dot_block: the next quantizer reads a dot's float32
      # sum; "swiglu" down's, "block" gate_up's too) against "split": GPU tests, then 36 layers
      # at batch 8 (4096-row prefill; bf16 beside the first), then the 8-layer prefill profile
      # (knobs: DF_VARIANTS, DF_SKIP_TESTS=1, DF_SKIP_PROFILE=1)
      if [ -z "${DF_SKIP_TESTS:-}" ]; then
        timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -rA -m gpu tests/test_dot_block_gpu.py \
          -p no:cacheprovider > "$out/dot_finish_pytest.log" 2>&1
        echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/dot_finish_pytest.log" | tail -5
      fi
      for df in ${DF_VARIANTS:-block swiglu split}; do
        modes="nvfp4"; [ $df = block ] && modes="nvfp4 bf16"
        timeout ${BENCH_TIMEOUT:-200} python3 experiments/bench_decode.py --modes $modes \
          --batch 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-dot-finish $df \
          --out "$out/decode_df_$df.json" > "$out/decode_df_$df.log" 2>&1
        echo "$df rc=$?"; grep -E "ms/token|prefill|FAILED|Error" "$out/decode_df_$df.log"
      done
      [ -n "${DF_SKIP_PROFILE:-}" ] && continue
      timeout ${PROFILE_TIMEOUT:-200} python3 experiments/profile_step.py --phase prefill \
        --layers 8 --steps 2 --variant nvfp4:8 --variant nvfp4:8:gemm_dot_finish=swiglu \
        --variant nvfp4:8:gemm_dot_finish=block \
        --out "$out/prefill_profile_df.json" > "$out/prefill_profile_df.log" 2>&1
      echo "profile rc=$?"; grep -E "^\[|cublas|xla_fusion|nvfp4_" "$out/prefill_profile_df.log" | head -30;;
    prefill_ab)
      # one process, the same weights: bf16, then NVFP4 for every PA_STREAM x PA_FINISH
      # (Config.gemm_dot_stream x gemm_dot_finish, the finish innermost so its values run
      # adjacent) at PA_BATCH (batch-8 prefill: 4096 rows, the dot path); PA_LAYERS, PA_REPEATS
      timeout ${BENCH_TIMEOUT:-540} python3 experiments/bench_decode.py --modes bf16 nvfp4 \
        --batch ${PA_BATCH:-8} --gen-len 32 --repeats ${PA_REPEATS:-5} --no-breakdown \
        ${PA_LAYERS:+--layers $PA_LAYERS} --gemm-dot-stream ${PA_STREAM:-main side} \
        --gemm-dot-finish ${PA_FINISH:-split block swiglu} \
        --out "$out/prefill_ab.json" > "$out/prefill_ab.log" 2>&1
      echo "bench rc=$?"; grep -E "ms/token|prefill|FAILED|Error|\] head" "$out/prefill_ab.log";;
    wgmma_4096)
      # the batch-8 prefill's 4096 rows on the wgmma GEMM (Config.gemm_wgmma_max_m "none": no
      # dequantizer, no float32 sums) against the dot path ("default": the dequantizer, cuBLAS
      # and the "block" finishes): the RASTER variants' bits first (M = 1100: a last group of
      # one token tile), kernel alone at M = 4096 (the four Qwen3-8B shapes, 128- and 256-token
      # tiles with and without RASTER, the dot path jitted, bf16), then 36 layers in one
      # process: the dot path, then the wgmma GEMM, each with RASTER 0 / 8 twice (ABAB; RASTER
      # changes nothing on the dot path, so its pairs are a noise check)
      timeout ${CHECK_TIMEOUT:-150} python3 experiments/kernels/check_gemm_wgmma.py --ms 1100 \
        --variants wgmma_n128_xb_r8,wgmma_n256_xb_r4 --no-time --out "$out/wgmma_4096_check.json" \
        > "$out/wgmma_4096_check.log" 2>&1; echo "check rc=$?"; tail -5 "$out/wgmma_4096_check.log"
      timeout ${KERNEL_TIMEOUT:-240} python3 experiments/bench_gemm.py --ms 4096 --old-ms 4096 \
        --shapes 6144:4096,4096:4096,24576:4096,4096:12288 \
        --variants ${W4096_VARIANTS:-wgmma_n128_xb,wgmma_n128_xb_r8,wgmma_n256_xb,wgmma_n256_xb_r4} \
        --ops gemm_graph,jax_bf16,dot_kernel \
        --time-budget ${WGMMA_TIME_BUDGET:-200} --out "$out/wgmma_4096_kernel.json" \
        > "$out/wgmma_4096_kernel.log" 2>&1; echo "kernel rc=$?"
      grep -E "geomean" "$out/wgmma_4096_kernel.log" | head -12
      timeout ${BENCH_TIMEOUT:-300} python3 experiments/bench_decode.py --modes bf16 nvfp4 \
        --batch 8 --gen-len 32 --repeats 5 --no-breakdown \
        --gemm-wgmma-max-m default none --gemm-wgmma-raster 0 8 0 8 \
        --out "$out/wgmma_4096_decode.json" \
        > "$out/wgmma_4096_decode.log" 2>&1
      echo "bench rc=$?"; grep -E "ms/token|FAILED|Error" "$out/wgmma_4096_decode.log";;
    tiles_chunk)
      # the "xhat_tiles" quantizer with whole-row chunks (chunk = K: one CTA an 8-row group,
      # the row statistics read once, the image in passes): its GPU test (bytes equal to the
      # default chunking's), then bench_quant_tiles.py's candidates at TILES_MS rows
      timeout ${PYTEST_TIMEOUT:-240} python3 -m pytest -rA -m gpu tests/test_quant_kernel_gpu.py \
        -k whole_row -p no:cacheprovider > "$out/tiles_chunk_pytest.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/tiles_chunk_pytest.log" | tail -5
      timeout ${BENCH_TIMEOUT:-240} python3 experiments/kernels/bench_quant_tiles.py \
        --ms ${TILES_MS:-512,2048,4096} --out "$out/tiles_chunk.json" > "$out/tiles_chunk.log" 2>&1
      echo "bench rc=$?"; grep -E "^xhat_tiles|bandwidth|Error" "$out/tiles_chunk.log" | head -90;;
    wgmma_ws)
      # the warp-specialized wgmma GEMM (WS 1, lost: a producer warpgroup decodes the weights
      # into shared memory, the consumers issue SS wgmmas), applied from
      # experiments/kernels/wgmma_ws.patch to this copy of the tree (later phases of the call
      # see it too): bits at M = 256 / 512 / 1100 and the large-tile extras (odd M, odd N),
      # then kernel alone at WS_MS (512 and 4096 rows) against the RS forms and jitted bf16
      git apply experiments/kernels/wgmma_ws.patch || { echo "wgmma_ws.patch does not apply"; exit 1; }
      timeout ${CHECK_TIMEOUT:-150} python3 experiments/kernels/check_gemm_wgmma.py \
        --ms ${WS_CHECK_MS:-256,512,1100} --no-time --out "$out/ws_check.json" \
        --variants ${WS_VARIANTS:-wgmma_n128_xb_ws,wgmma_n256_xb_ws,wgmma_n256_xb_ws_r4} \
        > "$out/ws_check.log" 2>&1; echo "check rc=$?"; tail -8 "$out/ws_check.log" | cut -c1-600
      timeout ${KERNEL_TIMEOUT:-240} python3 experiments/bench_gemm.py --ms ${WS_MS:-512,4096} \
        --old-ms 4096 --shapes 6144:4096,4096:4096,24576:4096,4096:12288 \
        --variants ${WS_BENCH_VARIANTS:-wgmma_n128_xb,wgmma_n256_xb_r4,wgmma_n128_xb_ws,wgmma_n256_xb_ws,wgmma_n256_xb_ws_r4} \
        --ops gemm_graph,jax_bf16 --time-budget ${WGMMA_TIME_BUDGET:-200} \
        --out "$out/ws_kernel.json" > "$out/ws_kernel.log" 2>&1; echo "kernel rc=$?"
      grep -E "geomean" "$out/ws_kernel.log" | head -20
      grep -E "^ +[0-9]+x[0-9]+ " "$out/ws_kernel.log" | tail -8;;
    dot_sanitize)
      # compute-sanitizer memcheck and racecheck on the dot finish's forms (rejax.ops.dot_block,
      # the default on the dot path): SwiGLU chunked, RMSNorm one CTA a row and chunked
      t=tests/test_dot_block_gpu.py::test_finish_dot_equals_the_quantizer_of_the_scaled_sum
      for tool in memcheck racecheck; do
        XLA_FLAGS=--xla_gpu_autotune_level=0 timeout ${SAN_TIMEOUT:-200} compute-sanitizer \
          --tool $tool --print-limit 20 python3 -m pytest -q -p no:cacheprovider -m gpu \
          "$t[64-2048-swiglu-True]" "$t[300-4096-rmsnorm-True]" "$t[64-2048-rmsnorm-False]" \
          > "$out/dot_sanitize_$tool.log" 2>&1
        echo "$tool rc=$?"
        grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed|failed|Invalid|hazard" \
          "$out/dot_sanitize_$tool.log" | head -8
      done;;
    dot_stream)
      # Config.gemm_dot_stream "side" (the dot path's dequantizer calls on XLA's stream 1)
      # against "main": the GPU test, then 36 layers at batch 8 (4096-row prefill; bf16 beside
      # the first; knobs DS_VARIANTS, DS_SKIP_TESTS=1, DS_BF16=0)
      if [ -z "${DS_SKIP_TESTS:-}" ]; then
        timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -rA -m gpu tests/test_dequant_gpu.py \
          -k dot_stream -p no:cacheprovider > "$out/dot_stream_pytest.log" 2>&1
        echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/dot_stream_pytest.log" | tail -3
      fi
      for ds in ${DS_VARIANTS:-side main}; do
        modes="nvfp4"; [ $ds = side ] && [ "${DS_BF16:-1}" = 1 ] && modes="nvfp4 bf16"
        timeout ${BENCH_TIMEOUT:-200} python3 experiments/bench_decode.py --modes $modes \
          --batch 8 --gen-len 32 --repeats 3 --no-breakdown --gemm-dot-stream $ds \
          ${DS_ARGS:-} --out "$out/decode_ds_$ds.json" > "$out/decode_ds_$ds.log" 2>&1
        echo "$ds rc=$?"; grep -E "ms/token|prefill|FAILED|Error" "$out/decode_ds_$ds.log"
      done;;
    stream_overlap)
      # experiments/stream_overlap_probe.py: does the dot path's dequantizer run beside a cuBLAS
      # dot when compute_on("gpu_stream:1") marks it? (4096 rows, gate_up's dot, down's weight)
      timeout ${PROBE_TIMEOUT:-240} python3 experiments/stream_overlap_probe.py \
        --git-sha "${GIT_SHA:-unknown}" --out "$out/stream_overlap.json" > "$out/stream_overlap.log" 2>&1
      echo "probe rc=$?"; tail -20 "$out/stream_overlap.log";;
    rows_inner)
      # experiments/kernels/quant_tiles_rows_inner.patch (the tiles form's row statistics with
      # the rows as the inner loop) in a copy of the tree: the tiles GPU tests there, then
      # bench_quant_tiles.py (RMSNorm and none, ROWS_MS) in the copy and in this tree
      ri=/tmp/rows_inner_tree; rm -rf $ri; mkdir -p $ri
      git ls-files -z | xargs -0 cp --parents -t $ri 2>/dev/null
      here=$PWD; (cd $ri && git apply "$here/experiments/kernels/quant_tiles_rows_inner.patch")
      echo "patch rc=$?"
      (cd $ri && REJAX_KERNEL_CACHE=/tmp/rk_rows_inner timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -rA -m gpu \
        tests/test_quant_kernel_gpu.py -k tiles -p no:cacheprovider) > "$out/rows_inner_pytest.log" 2>&1
      echo "pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/rows_inner_pytest.log" | tail -5
      for tree in patched base; do
        dir=$PWD; [ $tree = patched ] && dir=$ri
        (cd $dir && REJAX_KERNEL_CACHE=/tmp/rk_$tree timeout ${BENCH_TIMEOUT:-150} python3 \
          experiments/kernels/bench_quant_tiles.py --ms ${ROWS_MS:-512,2048} --inputs rmsnorm,none \
          --out "$out/rows_inner_$tree.json") > "$out/rows_inner_$tree.log" 2>&1
        echo "$tree rc=$?"; grep -E "chunk=  512 threads= 128|bandwidth|Error" "$out/rows_inner_$tree.log"
      done;;
    quant_rows)
      # the quantizer kernel's GPU tests, with its one-CTA-a-row path from 264 rows
      timeout ${PYTEST_TIMEOUT:-150} python3 -m pytest -rs -m gpu tests/test_quant_kernel_gpu.py \
        -k "${QUANT_K:-xhat or equals_quantize}" -p no:cacheprovider > "$out/quant_pytest.log" 2>&1
      echo "quant pytest rc=$?"; grep -E "^(FAILED|ERROR)|passed|failed" "$out/quant_pytest.log" | head;;
    prefill_profile)
      # every kernel of one 512-token prefill of PROFILE_LAYERS (8) layers: the default (the
      # dot path with the dequantizer), the mma.sync GEMM up to 512 rows, bf16; batch 1 and 8
      timeout ${PROFILE_TIMEOUT:-240} python3 experiments/profile_step.py --phase prefill \
        --layers ${PROFILE_LAYERS:-8} --steps 2 ${PREFILL_VARIANTS:---variant nvfp4:1 \
        --variant nvfp4:1:gemm_max_m=512 --variant bf16:1 --variant nvfp4:8 --variant bf16:8} \
        --out "$out/prefill_profile.json" > "$out/prefill_profile.log" 2>&1
      echo "profile rc=$?"; grep -vE "^\s*$|Warning|warn" "$out/prefill_profile.log" | tail -60;;
    accept_kernel)
      # [T2-C]'s kernel table: all 18 layer shapes, M = 8..256, the production GEMM, the
      # "fill16" plan below 16 rows, the model's wgmma kernel at 256 (ACCEPT_VARIANTS), the
      # M = 8 GEMV, jitted bf16 (about 3-4 minutes on an H100)
      timeout ${BENCH_TIMEOUT:-420} python3 experiments/bench_gemm.py \
        --variants ${ACCEPT_VARIANTS:-gemm,gemm_fill16,wgmma_n128_xb} \
        --ops gemm_graph,gemv_graph,jax_bf16 --ms 8,16,32,64,256 --time-budget 380 \
        --out "$out/bench_kernel_gemm.json" > "$out/bench_kernel_gemm.log" 2>&1; echo "bench rc=$?"
      grep -E "geomean" "$out/bench_kernel_gemm.log" | head -20;;
    accept_decode)
      # [T2-C]'s end-to-end rows (36 layers, prompt 512, 1024 new tokens, median of 3): NVFP4
      # and bf16 at batch 8 / 16 in one process, then batch 64 (NVFP4, then bf16 in a process of
      # its own: on an 80 GB card bf16's batch-64 prefill did not fit after the NVFP4 runs)
      timeout ${BENCH_TIMEOUT:-300} python3 experiments/bench_decode.py --modes nvfp4 bf16 \
        --batch 8 16 --gen-len 1024 --repeats 3 --no-breakdown --out "$out/decode_b8_b16.json" \
        > "$out/decode_b8_b16.log" 2>&1
      for mode in nvfp4 bf16; do
        timeout ${BENCH64_TIMEOUT:-150} python3 experiments/bench_decode.py --modes $mode \
          --batch 64 --gen-len 1024 --repeats 3 --no-breakdown --out "$out/decode_b64_$mode.json" \
          > "$out/decode_b64_$mode.log" 2>&1
      done
      grep -hE "ms/token|FAILED" "$out"/decode_b8_b16.log "$out"/decode_b64_*.log;;
    profile)
      variants=""
      for b in ${PROFILE_BATCHES:-64 16}; do variants="$variants --variant nvfp4:$b --variant bf16:$b"; done
      [ -n "${PROFILE_VARIANTS:-}" ] && variants=$(printf -- ' --variant %s' $PROFILE_VARIANTS)
      timeout ${PROFILE_TIMEOUT:-300} python3 experiments/profile_step.py --layers 8 --steps 16 \
        $variants --out "$out/profile.json" > "$out/profile.log" 2>&1; echo "profile rc=$?"
      python3 - "$out/profile.json" <<'PY'
import json, sys
for v in json.load(open(sys.argv[1]))["results"]:
    if "error" in v:
        print(v["variant"], "failed:", v["error"]); continue
    print(v["variant"], "busy", round(v["busy_us_per_step"]), "span", round(v["span_us_per_step"]),
          "us/step, launches", v["launches_per_step"])
    for name, c in (v["classes"].items() if isinstance(v["classes"], dict) else v["classes"]):
        print(f"   {name:12s} {c['per_layer']:6.2f} launches {c['us_per_layer']:8.1f} us a layer")
    for r in v["top"][:16]:
        print(f"      {r['us_per_step']:8.1f} us/step {r['per_step']:6.2f}x {r['name'][:70]}")
PY
      ;;
    *) echo "unknown phase $phase";;
  esac
  echo "[$phase: $(( $(date +%s) - t0 )) s]"
done
