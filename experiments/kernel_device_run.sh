#!/usr/bin/env bash
# One device session for the NVFP4 GEMV: environment, ptxas resource report, correctness
# sweep, benchmark and compute-sanitizer. Usage: experiments/kernel_device_run.sh OUTDIR [phases]
# phases (default all): env ptxas check pytest bench sanitize; also ncu quantcheck diag tune
# variants (persistent vs stream GEMV) timing (jit vs CUDA graph, command buffers)
# ring signed xplanes ab (kernel variants by environment, CUDA-graph timings) jitcheck
set -uo pipefail
out=${1:?output dir}; shift
phases=${*:-env ptxas check bench sanitize}
export PYTHONPATH=. XLA_PYTHON_CLIENT_PREALLOCATE=false PYTHONUNBUFFERED=1
export REJAX_KERNEL_CACHE=${REJAX_KERNEL_CACHE:-/tmp/rejax-kernels}
mkdir -p "$out"
for phase in $phases; do
  t0=$(date +%s)
  case $phase in
    env)
      { nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv
        python3 -c "import jax, jaxlib, cuda.bindings, torch; from cuda_ops.build import nvrtc_version; \
print('jax', jax.__version__, 'cuda-bindings', cuda.bindings.__version__, 'torch', torch.__version__, \
'nvrtc', nvrtc_version(), jax.devices(), jax.devices()[0].core_count)"
        nvcc --version | tail -2; } >> "$out/notes.txt" 2>&1; cat "$out/notes.txt";;
    ptxas)
      for cfg in "1 4096 12288 4 2 512 1" "8 4096 12288 4 4 256 1" "1 4096 12288 2 6 256 0" \
                 "8 5120 25600 4 9 256 1"; do
        set -- $cfg
        echo "== M=$1 N=$2 K=$3 R=$4 SPP=$5 T=$6 W4A4=$7"
        nvcc -arch=sm_90 -cubin -o /tmp/k.cubin -Xptxas -v -DM_TOK=$1 -DN_OUT=$2 -DK_IN=$3 \
          -DR_ROWS=$4 -DSPP=$5 -DNTHREADS=$6 -DACT_W4A4=$7 -DGRID=132 cuda_ops/nvfp4_gemv.cu 2>&1 \
          | grep -E "registers|spill|error" ;
      done > /tmp/ptxas.txt 2>&1
      if grep -q error /tmp/ptxas.txt; then  # cache hints rejected: plain .nc loads
        export REJAX_GEMV_LDW='".L1::no_allocate"' REJAX_GEMV_LDX='""'
        echo "FALLBACK cache hints: LDW=$REJAX_GEMV_LDW LDX=$REJAX_GEMV_LDX" >> /tmp/ptxas.txt
        nvcc -arch=sm_90 -cubin -o /tmp/k.cubin -Xptxas -v -DM_TOK=8 -DN_OUT=4096 -DK_IN=4096 \
          -DR_ROWS=4 -DSPP=1 -DNTHREADS=256 -DACT_W4A4=1 -DGRID=132 "-DLDW_HINT=$REJAX_GEMV_LDW" \
          "-DLDX_HINT=$REJAX_GEMV_LDX" cuda_ops/nvfp4_gemv.cu >> /tmp/ptxas.txt 2>&1
      fi
      cuobjdump -sass /tmp/k.cubin > /tmp/sass.txt 2>&1
      for op in IDP4A PRMT LDG.E.128 LDS.128 SHFL FFMA FADD STL LDL; do
        echo "$op $(grep -c "$op" /tmp/sass.txt)"; done >> /tmp/ptxas.txt
      cat /tmp/ptxas.txt | tee -a "$out/notes.txt";;
    check)
      timeout ${CHECK_TIMEOUT:-600} python3 experiments/gpu_kernel_check.py ${CHECK_ARGS:---quick} --out "$out/check.json" \
        > /tmp/check.log 2>&1; grep -E "FAIL|rror|prebuilt" /tmp/check.log | head -20
      tail -12 /tmp/check.log;;
    pytest)
      timeout ${PYTEST_TIMEOUT:-600} python3 -m pytest -q -m gpu tests/test_kernels_gpu.py \
        ${PYTEST_K:+-k "$PYTEST_K"} > "$out/pytest.log" 2>&1
      tail -15 "$out/pytest.log";;
    bench)
      python3 experiments/bench_kernel.py ${BENCH_ARGS:-} --out "$out/bench_kernel.json" \
        > "$out/bench.log" 2>&1; tail -60 "$out/bench.log";;
    sanitize)
      for tool in memcheck racecheck; do
        timeout ${SAN_TIMEOUT:-150} compute-sanitizer --tool $tool python3 experiments/gpu_kernel_check.py \
          --sanitize 2>&1 | tail -6
      done > /tmp/sanitize.txt 2>&1; cat /tmp/sanitize.txt | tee -a "$out/notes.txt";;
    ncu)
      timeout ${NCU_TIMEOUT:-120} ncu --clock-control none -k regex:nvfp4_gemv --launch-count 6 \
        --section SpeedOfLight --section ComputeWorkloadAnalysis --section Occupancy \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats \
        python3 experiments/gpu_kernel_check.py --profile > /tmp/ncu.txt 2>&1
      cp /tmp/ncu.txt "$out/ncu_full.txt"
      grep -E "nvfp4_gemv|Duration|Memory Throughput|DRAM Throughput|Compute \(SM\)|Executed Ipc|Issue Slots|Achieved Occupancy|Registers|Theoretical Occ|Block Limit|One or More|No Eligible|Eligible Warps|Active Warps|Warp Cycles|Pipe|ALU|FMA|Max Bandwidth|L1/TEX Hit|L2 Hit|est. " /tmp/ncu.txt \
        | head -150 | tee "$out/ncu.txt";;
    quantcheck)
      python3 - <<'PY' 2>&1 | tee -a "$out/notes.txt"
import jax, jax.numpy as jnp, numpy as np
from rejax import nvfp4
x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 4096)), jnp.bfloat16)
e = nvfp4.quantize_activation(x); j = jax.jit(nvfp4.quantize_activation)(x)
for f in ("packed", "scales", "global_scale"):
    a, b = np.asarray(getattr(e, f)).view(np.uint8), np.asarray(getattr(j, f)).view(np.uint8)
    print("quantize_activation eager vs jit on GPU:", f, "differing bytes", int((a != b).sum()), "of", a.size)
PY
      ;;
    diag)
      for v in "0" "1"; do
        echo "== DIAG_NODOT=$v"
        REJAX_GEMV_DIAG_NODOT=$v timeout 100 python3 experiments/bench_kernel.py \
          --shapes 4096:12288,25600:5120 --ms 1,8 --ops nvfp4_w4a4 --no-chain --out /tmp/diag.json \
          2>&1 | grep -A6 "N x K"
      done 2>&1 | tee "$out/diag.txt";;
    variants)  # persistent vs stream (REJAX_GEMV_VARIANT), same shapes, M = 1, 2, 4
      for cfg in "1 2 4 1" "2 2 4 1" "4 1 8 1" "1 2 4 0" "2 1 8 0"; do  # M R KSPLIT W4A4
        set -- $cfg
        echo "== stream ptxas M=$1 R=$2 KSPLIT=$3 W4A4=$4"
        nvcc -arch=sm_90 -cubin -o /tmp/s.cubin -Xptxas -v -DGEMV_STREAM=1 -DM_TOK=$1 \
          -DN_OUT=4096 -DK_IN=12288 -DR_ROWS=$2 -DKSPLIT=$3 -DACT_W4A4=$4 -DNTHREADS=256 \
          -DSPP=1 -DGRID=1 cuda_ops/nvfp4_gemv.cu 2>&1 | grep -E "registers|spill|error"
      done 2>&1 | tee "$out/variants_ptxas.txt"
      for v in persistent stream; do
        REJAX_GEMV_VARIANT=$v timeout 200 python3 experiments/bench_kernel.py \
          --shapes ${VARIANT_SHAPES:-4096:4096,6144:4096,12288:4096,4096:12288,1024:4096,5120:25600} \
          --ms 1,2,4 --ops nvfp4_w4a4,nvfp4_w4a16,jax_bf16 --no-chain --out "$out/variant_$v.json" \
          > /tmp/variant.log 2>&1
        echo "== $v"; grep -A20 "N x K" /tmp/variant.log
      done 2>&1 | tee "$out/variants.txt";;
    timing)  # jit (host clock) vs CUDA-graph (device) timing, command buffers on / off
      for cfg in "persistent:" "stream:" "persistent:--xla_gpu_enable_command_buffer="; do
        v=${cfg%%:*}; flags=${cfg#*:}; d=/tmp/dump_$RANDOM
        XLA_FLAGS="$flags --xla_dump_to=$d --xla_dump_hlo_as_text" REJAX_GEMV_VARIANT=$v \
          timeout 200 python3 experiments/bench_kernel.py \
          --shapes ${TIMING_SHAPES:-1024:4096,4096:4096,4096:12288,5120:25600} --ms ${TIMING_MS:-1,8} \
          --ops nvfp4_w4a4,nvfp4_w4a4_graph,nvfp4_w4a16_graph,jax_bf16,torch_bf16 --no-chain \
          --out "$out/timing_$v${flags:+_nocmdbuf}.json" > /tmp/timing.log 2>&1
        echo "== variant=$v XLA_FLAGS=$flags; optimized modules with command buffers:" \
          "$(grep -l command_buffer $d/*after_optimizations.txt 2>/dev/null | wc -l)" \
          "of $(ls $d/*after_optimizations.txt 2>/dev/null | wc -l)"
        grep -E "^\{" /tmp/timing.log | python3 -c "
import json, sys
for l in sys.stdin:
    r = json.loads(l)
    print(r['n'], r['k'], r['m'], ' '.join(f'{k[:-2]}={v * 1e6:.2f}' for k, v in r.items() if k.endswith('_s')))"
        tail -3 /tmp/timing.log | grep -i error
      done 2>&1 | tee "$out/timing.txt";;
    ring)  # cp.async ring vs register double buffer vs stream: jit and CUDA-graph timings
      for cfg in "1 4096 12288 4 2 512 1 4" "8 4096 12288 4 1 256 1 4" "1 4096 12288 2 1 256 0 4"; do
        set -- $cfg
        echo "== ring ptxas M=$1 N=$2 K=$3 R=$4 SPP=$5 T=$6 W4A4=$7 RING_D=$8"
        nvcc -arch=sm_90 -cubin -o /tmp/r.cubin -Xptxas -v -DM_TOK=$1 -DN_OUT=$2 -DK_IN=$3 \
          -DR_ROWS=$4 -DSPP=$5 -DNTHREADS=$6 -DACT_W4A4=$7 -DRING_D=$8 -DGRID=132 \
          cuda_ops/nvfp4_gemv.cu 2>&1 | grep -E "registers|spill|error"
      done 2>&1 | tee "$out/ring_ptxas.txt"
      ops=nvfp4_w4a4,nvfp4_w4a4_graph,jax_bf16
      for cfg in "ring:persistent:4" "regs:persistent:0" "stream:stream:4"; do
        IFS=: read name v d <<< "$cfg"
        REJAX_GEMV_VARIANT=$v REJAX_GEMV_RING=$d timeout ${RING_TIMEOUT:-150} python3 \
          experiments/bench_kernel.py --shapes ${RING_SHAPES:-3584:3584,4096:4096,4096:12288,5120:25600} \
          --ms ${RING_MS:-1,2,4,8} --ops $ops --no-chain --out "$out/ring_$name.json" > /tmp/ring.log 2>&1
        ops=nvfp4_w4a4,nvfp4_w4a4_graph
        echo "== $name"; grep -A20 "N x K" /tmp/ring.log; grep -iE "error|Traceback" /tmp/ring.log | head -3
      done 2>&1 | tee "$out/ring.txt";;
    signed)  # W4A4 M > 2: signed int8 weight decode (one dp4a per 4 weights) vs pos/neg pairs,
             # and M = 8 with R = 2 rows x 512 threads; kernel alone in CUDA graphs
      for cfg in ${SIGNED_CFGS:-pn:0:: s8:1:: s8r2t512:1:2:512}; do
        IFS=: read name sg rows thr <<< "$cfg"
        REJAX_GEMV_SIGNED=$sg REJAX_GEMV_ROWS=$rows REJAX_GEMV_THREADS=$thr timeout 120 python3 \
          experiments/bench_kernel.py --shapes ${SIGNED_SHAPES:-4096:4096,4096:12288,5120:25600} \
          --ms 4,8 --ops nvfp4_w4a4_graph --no-chain --out "$out/signed_$name.json" > /tmp/signed.log 2>&1
        echo "== $name"; grep -iE "error|Traceback" /tmp/signed.log | head -3
        python3 -c "
import json, sys
for r in json.load(open('$out/signed_$name.json'))['rows']:
    print(r['n'], r['k'], r['m'], round(r['nvfp4_w4a4_graph_s'] * 1e6, 2))"
      done 2>&1 | tee "$out/signed.txt";;
    xplanes)  # staged x in two planes (conflict-free 128-bit smem reads) vs element order, and
              # the read-only floor of the same bytes; kernel alone in CUDA graphs
      for v in 0 1; do
        REJAX_GEMV_XPLANES=$v timeout 150 python3 experiments/bench_kernel.py \
          --shapes ${XPLANES_SHAPES:-4096:4096,4096:12288,5120:25600} --ms 1,4,8 \
          --ops nvfp4_w4a4_graph,read_floor_graph --no-chain --out "$out/xplanes_$v.json" \
          > /tmp/xplanes.log 2>&1
        echo "== XPLANES=$v"; grep -iE "error|Traceback" /tmp/xplanes.log | head -3
        python3 -c "
import json
for r in json.load(open('$out/xplanes_$v.json'))['rows']:
    print(r['n'], r['k'], r['m'], round(r['nvfp4_w4a4_graph_s'] * 1e6, 2),
          'floor', round(r.get('read_floor_graph_s', 0) * 1e6, 2))"
      done 2>&1 | tee "$out/xplanes.txt";;
    ab)  # this tree's kernel against another revision of the source (REJAX_GEMV_SOURCE, e.g. the
         # last commit's: git show HEAD~1:cuda_ops/nvfp4_gemv.cu > experiments/nvfp4_gemv_prev.cu),
         # the load-only diagnostic build, persistent at every size, staged x in two planes;
         # kernel alone in CUDA graphs, the read-only floor of the same bytes with the first config
      first=1
      for cfg in ${AB_CFGS:-new: prev:REJAX_GEMV_SOURCE=experiments/nvfp4_gemv_prev.cu \
                  loadonly:REJAX_GEMV_DIAG_LOADONLY=1 pers:REJAX_GEMV_VARIANT=persistent \
                  xplanes:REJAX_GEMV_XPLANES=1}; do
        name=${cfg%%:*}; envs=${cfg#*:}; envs=${envs//,/ }  # NAME:VAR=1,VAR2=2
        ops=nvfp4_w4a4_graph; [ $first = 1 ] && ops=$ops,${AB_FLOORS:-read_floor_graph}; first=0
        env $envs timeout ${AB_TIMEOUT:-110} python3 experiments/bench_kernel.py \
          --shapes ${AB_SHAPES:-4096:4096,4096:12288,5120:25600,25600:5120} --ms ${AB_MS:-1,2,4,8} \
          --ops $ops --no-chain --out "$out/ab_$name.json" > /tmp/ab.log 2>&1
        echo "== $name ($envs)"; grep -iE "error|Traceback" /tmp/ab.log | head -3
        python3 -c "
import json
for r in json.load(open('$out/ab_$name.json'))['rows']:
    print(r['n'], r['k'], r['m'], round(r['nvfp4_w4a4_graph_s'] * 1e6, 2),
          'floor', round(r.get('read_floor_graph_s', 0) * 1e6, 2),
          'floor_1cta', round(r.get('read_floor_1cta_graph_s', 0) * 1e6, 2))"
        rm -f "$out/ab_$name.png"
      done 2>&1 | tee "$out/ab.txt";;
    jitcheck)  # why the jitted custom call costs more than the kernel at small layers
      for flags in "" "--xla_gpu_enable_command_buffer="; do
        XLA_FLAGS="$flags" timeout 150 python3 experiments/bench_kernel.py \
          --shapes 3584:3584,4096:4096,4096:12288 --ms 1 \
          --ops nvfp4_w4a4,nvfp4_w4a4_jit_sum,nvfp4_w4a4_graph,jax_bf16 --no-chain \
          --out "$out/jitcheck${flags:+_nocmdbuf}.json" > /tmp/jitcheck.log 2>&1
        echo "== XLA_FLAGS=$flags"; grep -E '^\{"n"' /tmp/jitcheck.log | cut -c1-400
      done 2>&1 | tee "$out/jitcheck.txt";;
    tune)
      for v in ${TUNE_VARIANTS:-4:512 8:512 2:512 4:256 2:256 4:384}; do
        set -- ${v%:*} ${v#*:}
        REJAX_GEMV_ROWS=$1 REJAX_GEMV_THREADS=$2 timeout 100 python3 experiments/bench_kernel.py \
          --shapes 4096:12288,5120:25600,6144:4096,3584:18944 --ms 1,8 --ops nvfp4_w4a4 --no-chain \
          --out /tmp/tune_$1_$2.json > /tmp/tune.log 2>&1
        echo "== R=$1 T=$2"; grep -A8 "N x K" /tmp/tune.log
      done 2>&1 | tee "$out/tune.txt";;
  esac
  echo "[phase $phase took $(( $(date +%s) - t0 )) s]"
done
