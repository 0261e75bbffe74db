"""Benchmark of the NVFP4 W4A4 tensor-core GEMM (cuda_ops/nvfp4_gemm) on the paper's layer shapes.

Per unique (N, K) of the paper's models (18) and M in {8, 16, 32, 64, 128, 256}:
  * gemm (ours), per tile variant (`--variants`): the kernel alone (plus its split-K epilogue
    kernel when the plan splits K) in a CUDA graph of direct launches over enough distinct
    weight copies to read > 256 MiB (L2 is 60 MB), timed with CUDA events, on pre-built
    operands (x_hat fp16 from NVFP4 activations);
  * gemv (M <= 8): the small-M GEMV the dispatch uses there, timed the same way;
  * jax bf16: `jnp.dot(x, w.T)` over bf16 weight copies in one jit (host clock), the baseline;
  * torch bf16: `F.linear` over bf16 weight copies in a CUDA graph (cuBLAS), a second baseline;
  * old path (`--old-ms`): what M > 8 ran before the GEMM, the reference lowering on CUDA
    (XLA's fusions dequantize every weight to bf16, then one bf16 dot), jitted;
  * dot kernel (op `dot_kernel`, at the `--old-ms`): the same dot path with the weights decoded
    by the dequantizer kernel (`GemmOptions.dot_dequant="kernel"`), jitted;
  * gemm jit (`--jit-ms`): our whole jitted path (activation x_hat fusion + kernel(s)) through
    the PTX custom call;
  * xprep (at the `--jit-ms`): the jitted activation quantization + x_hat fusion alone (the
    GEMM's input cost).
Median over trials, warm-up excluded; the copy bandwidth is measured in the same run. Geomeans
per M over the shapes (speedup = bf16 time / ours) go to `targets`. Writes JSON.

A run that is cut by `--time-budget` lists what it skipped: the kernels and both baselines run
first at every M over all shapes, the jitted extras (old path, jitted path, xprep) after them.

Correctness is the GPU tests' job (tests/test_gemm_gpu.py); compute-sanitizer:
    compute-sanitizer --tool memcheck python -m pytest tests/test_gemm_gpu.py -q -k sanitizer
    compute-sanitizer --tool racecheck python -m pytest tests/test_gemm_gpu.py -q -k sanitizer

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from experiments import bench_kernel as bk
from experiments.kernel_shapes import all_shapes, unique_shapes

# name -> GemmOptions fields; "gemm" is the plan's default
VARIANTS = {
    "gemm": {},
    "gemm_kt256": {"kt": 256},
    "gemm_kt128": {"kt": 128},
    "gemm_wr1": {"wr": 1},
    "gemm_w8": {"warps": 8, "wr": 1},
    "gemm_nosplit": {"splitk": 1},
    "gemm_wm2": {"wm": 2},
    "gemm_cluster": {"reduce": "cluster"},
    # more CTAs per SM at small M (the default plan aims at about two; the GEMM measured at
    # 10-24% of the copy bandwidth at M = 16..64, experiments/results/h200_c/)
    "gemm_sk4": {"splitk": 4},
    "gemm_sk8": {"splitk": 8},
    "gemm_wr1_sk4": {"wr": 1, "splitk": 4},
    "gemm_wr1_sk8": {"wr": 1, "splitk": 8},
    "gemm_cluster_wr1": {"reduce": "cluster", "wr": 1},
    # the plan's rule that picks about the winners of the above (experiments/results/h200_e/),
    # the default since h200_f/; "gemm_base" is the rule before it
    "gemm_wide": {"occupancy": "wide"},
    "gemm_base": {"occupancy": "base"},
    # more warps per SM at M = 16..64 (the default plan has 8 warps of 169 registers per SM):
    # two or four warps along M split the tokens (each decodes its weight rows), or eight
    # warps along N of one 16-row tile each (ptxas, sm_90, M = 64: 76 / 66 / 105 registers)
    "gemm_wm2_any": {"wm": 2},
    "gemm_wm4": {"wm": 4, "warps": 8},
    "gemm_wm2_w16": {"wm": 2, "warps": 16, "wr": 1},
    "gemm_wm4_w16": {"wm": 4, "warps": 16},
    "gemm_w8_s2": {"warps": 8, "wr": 1, "stages": 2},
    "gemm_w8_sk4": {"warps": 8, "wr": 1, "splitk": 4},
    # the pipeline depth and K split sized by the CTAs an SM holds (ncu: the "wide" M = 64 plan
    # sits at 2 CTAs per SM, held there by its shared memory, over 2.18 waves); "_s3" keeps 3
    # stages and sizes only the split
    "gemm_fill": {"occupancy": "fill"},
    "gemm_fill_s3": {"occupancy": "fill", "stages": 3},
    # fewer than 16 rows in the 16-token tile of the 16-row plan (batch 8; the rows past M masked)
    "gemm_fill16": {"occupancy": "fill16"},
}
# the wgmma GEMM with 128 / 256-token tiles (cuda_ops/nvfp4_gemm_wgmma.py, opt-in: each weight
# decoded once per tile, for M >= 128): name -> its check's variant (the plan's keyword options).
# "wgmma_n128_xb" is the plan `build_linear` gives the model (BULK 3: x_hat pre-tiled, timed on
# its stage tiles; the weights as they are)
WGMMA_VARIANTS = {"wgmma_n128": "wgmma_n128", "wgmma_n128_wr2": "wgmma_n128_wr2",
                  "wgmma_n256": "wgmma_n256", "wgmma_n128_g4": "wgmma_n128_g4",
                  "wgmma_n128_wr2_g4": "wgmma_n128_wr2_g4", "wgmma_n128_xb": "wgmma_n128_xb",
                  "wgmma_n128_wr2_xb": "wgmma_n128_wr2_xb",
                  "wgmma_n128_xb_wave": "wgmma_n128_xb_wave",
                  "wgmma_n256_xb": "wgmma_n256_xb", "wgmma_n128_xb_r8": "wgmma_n128_xb_r8",
                  "wgmma_n256_xb_r4": "wgmma_n256_xb_r4"}  # fmt: skip
_LARGE_MS = set(range(128, 1 << 16))
# variants that only make sense at some M (others skip them there)
VARIANT_MS = {
    "gemm_wm2": {128, 256, 512},
    "gemm_fill16": set(range(1, 16)),
    **{v: _LARGE_MS for v in WGMMA_VARIANTS},
}


def _options(name):
    from cuda_ops import nvfp4_gemm

    return nvfp4_gemm.GemmOptions(**VARIANTS[name])


def _wgmma_plan(name, m, n, k):
    """The plan of a `WGMMA_VARIANTS` kernel (CPU only)."""
    from cuda_ops import nvfp4_gemm_wgmma as wgm
    from experiments.kernels import check_gemm_wgmma as chk

    return wgm.plan(m, n, k, **chk.VARIANTS[WGMMA_VARIANTS[name]])


def _build_variant(name, m, n, k):
    """The kernel a variant times: production's GEMM with its options, or the wgmma experiment's
    (the same launch interface; its x_hat operand is in another K order)."""
    if name in WGMMA_VARIANTS:
        from cuda_ops import nvfp4_gemm_wgmma as wgm

        return wgm.build_plan(_wgmma_plan(name, m, n, k))
    from cuda_ops import nvfp4_gemm

    return nvfp4_gemm.build(m, n, k, options=_options(name))


def time_gemm_graph(torch, kernel, xh, xg, weights, wg, layer0):
    """Device time per call of the GEMM (and its split-K epilogue) alone: one CUDA graph of
    direct launches over the weight copies, CUDA events."""
    import jax

    # raw pointers go to launches on torch's stream, which does not wait for JAX's transfers
    jax.block_until_ready((xh, xg, weights, wg, layer0))
    p = kernel.plan
    outs = [torch.empty((p.m, p.n), dtype=torch.bfloat16, device="cuda") for _ in weights]
    work = None
    if p.partials:  # one workspace: the launches run in order on one stream
        work = torch.empty(p.out_shape, dtype=torch.float32, device="cuda")
    fixed = [xh.unsafe_buffer_pointer(), xg.unsafe_buffer_pointer()]

    def mk(i):
        wp, ws = weights[i]
        ptrs = [
            *fixed,
            wp.unsafe_buffer_pointer(),
            ws.unsafe_buffer_pointer(),
            wg.unsafe_buffer_pointer(),
            layer0.unsafe_buffer_pointer(),
            outs[i].data_ptr(),
        ]
        wptr = None if work is None else work.data_ptr()

        def fn():
            kernel.launch(torch.cuda.current_stream().cuda_stream, ptrs, wptr)

        return fn

    return bk.time_torch_graph(torch, [mk(i) for i in range(len(weights))])


CORE_OPS = ("gemm_graph", "gemv_graph", "jax_bf16", "torch_bf16")
EXTRA_OPS = ("old_path", "dot_kernel", "gemm_jit", "xprep")


def bench_shape(torch, n, k, ms, ops, variants, old_ms, jit_ms):
    import jax
    import jax.numpy as jnp

    from cuda_ops import nvfp4_gemm
    from rejax import nvfp4
    from rejax.ops import _dispatch
    from rejax.ops import linear as kernels

    rows = []
    key = jax.random.PRNGKey(n * 7 + k)
    nv_bytes = n * k // 2 + n * k // 16
    c_nv, c_bf = bk._copies(nv_bytes), bk._copies(2 * n * k)
    kw, ks, kx = jax.random.split(key, 3)
    wps = [
        jax.random.randint(jax.random.fold_in(kw, i), (n, k // 2), 0, 256, jnp.int32).astype(
            jnp.uint8
        )
        for i in range(c_nv)
    ]
    wss = [
        jax.random.randint(jax.random.fold_in(ks, i), (n, k // 16), 0x20, 0x78, jnp.int32).astype(
            jnp.uint8
        )
        for i in range(c_nv)
    ]
    weights = list(zip(wps, wss, strict=True))
    wg = jnp.float32(1e-3)
    wbf = None
    if "jax_bf16" in ops:
        wbf = [
            jax.random.normal(jax.random.fold_in(kw, 1000 + i), (n, k), jnp.bfloat16) * 0.02
            for i in range(c_bf)
        ]
    wt = None
    if "torch_bf16" in ops:
        wt = [torch.randn((n, k), device="cuda", dtype=torch.bfloat16) for _ in range(c_bf)]
    layer0 = bk.LAYER0
    launch = _dispatch.default_launch()
    for m in ms:
        row = {"n": n, "k": k, "m": m, "nvfp4_bytes": nv_bytes, "copies": c_nv}
        x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
        xq = nvfp4.quantize_activation(x)
        xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
        xg = jnp.asarray(xq.global_scale, jnp.float32)
        xh = jax.block_until_ready(jax.jit(kernels.gemm_x_operand)(xq.packed, xs))
        xh_wgmma = None
        if "gemm_graph" in ops:
            for name in variants:
                if m not in VARIANT_MS.get(name, {m}):
                    continue
                try:
                    kern = _build_variant(name, m, n, k)
                    operand = xh
                    if name in WGMMA_VARIANTS:
                        from cuda_ops import nvfp4_gemm_wgmma as wgm

                        if xh_wgmma is None:
                            xh_wgmma = jax.jit(wgm.wgmma_x_operand)(xq.packed, xs)
                        operand = jax.block_until_ready(xh_wgmma)
                        if kern.plan.bulk:  # x_hat as stage tiles; no variant here tiles weights
                            assert kern.plan.bulk != 1, name
                            operand = jax.block_until_ready(
                                wgm.to_stage_tiles(operand, kern.plan.tm, kern.plan.kt)
                            )
                    row[f"{name}_plan"] = {
                        "grid": kern.plan.grid,
                        "threads": kern.plan.threads,
                        "smem": kern.plan.smem,
                        "splitk": kern.plan.splitk,
                        "tm": kern.plan.tm,
                        "kt": kern.plan.kt,
                        "stages": kern.plan.stages,
                    }
                    row[f"{name}_graph_s"] = time_gemm_graph(
                        torch, kern, operand, xg, weights, wg, layer0
                    )
                except Exception as err:  # noqa: BLE001
                    row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
        if "gemv_graph" in ops and m <= 8:
            try:
                row["gemv_graph_s"] = bk.time_kernel_graph(
                    torch, "w4a4", m, n, k, (xq.packed, xs, xg), weights, wg
                )
            except Exception as err:  # noqa: BLE001
                row["gemv_error"] = f"{type(err).__name__}: {err}"[:300]
        if "xprep" in ops and m in jit_ms:

            def prep(v):
                q = nvfp4.quantize_activation(v)
                return kernels.gemm_x_operand(
                    q.packed, jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
                )

            row["xprep_s"] = bk.time_jax(jax.jit(prep), (x,), 1, calls=20, trials=5)
        if "jax_bf16" in ops:
            f = jax.jit(lambda ws, x=x: [jnp.dot(x, w.T) for w in ws])
            row["jax_bf16_s"] = bk.time_jax(f, (wbf,), c_bf, calls=5, trials=5)
        if "torch_bf16" in ops:
            xt = torch.randn((m, k), device="cuda", dtype=torch.bfloat16)
            outs = [None] * c_bf

            def mk(i, xt=xt, outs=outs, wt=wt):
                def fn():
                    outs[i] = torch.nn.functional.linear(xt, wt[i])

                return fn

            row["torch_bf16_s"] = bk.time_torch_graph(torch, [mk(i) for i in range(c_bf)])
        args = (xq.packed, xs, xg)

        def dot_path(opts, args=args, wps=wps, wss=wss):
            # the activations come in as arguments too: closed over, XLA constant-folds their
            # decode (seconds of compile at M = 4096)
            def run(wps, wss, args):
                return [
                    kernels.gemv_call(
                        (*args, wp, ws, wg, layer0), act="w4a4", n=n, k=k, impl="auto",
                        launch=launch, gemm_options=opts,
                    )
                    for wp, ws in zip(wps, wss, strict=True)
                ]  # fmt: skip

            return bk.time_jax(jax.jit(run), (wps[:8], wss[:8], args), 8, calls=3, trials=3)

        if "old_path" in ops and m in old_ms and m > 8:
            # the reference lowering on CUDA with XLA's decode: GEMM disabled by a min_m no
            # batch reaches
            row["old_path_s"] = dot_path(
                nvfp4_gemm.GemmOptions(min_m=1 << 30, max_m=None, dot_dequant="xla")
            )
        if "dot_kernel" in ops and m in old_ms and m > 1:
            # the dot path as prefill runs it above max_m rows, with the dequantizer kernel
            # (GemmOptions.dot_dequant "kernel") instead of XLA's decode
            row["dot_kernel_s"] = dot_path(
                nvfp4_gemm.GemmOptions(min_m=1, max_m=1, dot_dequant="kernel")
            )
        if "gemm_jit" in ops and m in jit_ms:

            def ours(wps, wss, args=args):
                return [
                    kernels.gemv_call(
                        (*args, wp, ws, wg, layer0), act="w4a4", n=n, k=k, impl="cuda",
                        launch=launch,
                    )
                    for wp, ws in zip(wps, wss, strict=True)
                ]  # fmt: skip

            try:
                row["gemm_jit_s"] = bk.time_jax(jax.jit(ours), (wps, wss), c_nv, calls=5, trials=5)
            except Exception as err:  # noqa: BLE001
                row["gemm_jit_error"] = f"{type(err).__name__}: {err}"[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del wps, wss, weights, wbf, wt
    gc.collect()
    return rows


def _geo(values):
    return float(np.exp(np.mean(np.log(values)))) if values else None


def summarize(rows, copy_bw, variants):
    derived, targets = [], {}
    for r in rows:
        d = {"n": r["n"], "k": r["k"], "m": r["m"]}
        bf = r.get("jax_bf16_s")
        times = {v: r[f"{v}_graph_s"] for v in variants if f"{v}_graph_s" in r}
        if times:
            best = min(times, key=times.get)
            d["best_variant"], d["best_us"] = best, times[best] * 1e6
            d["best_pct_copy_bw"] = 100 * r["nvfp4_bytes"] / times[best] / copy_bw
        for v, t in times.items():
            d[f"{v}_us"] = t * 1e6
            if bf:
                d[f"{v}_x_bf16"] = bf / t
        if bf:
            d["bf16_us"] = bf * 1e6
            if times:
                d["best_x_bf16"] = bf / min(times.values())
        for name in ("gemv_graph", "old_path", "dot_kernel", "gemm_jit", "xprep", "torch_bf16"):
            if f"{name}_s" in r:
                d[f"{name}_us"] = r[f"{name}_s"] * 1e6
                if bf:
                    d[f"{name}_x_bf16"] = bf / r[f"{name}_s"]
        derived.append(d)
    for m in sorted({d["m"] for d in derived}):
        ds = [d for d in derived if d["m"] == m]
        for key in ["best", *variants, "gemv_graph", "old_path", "dot_kernel", "gemm_jit"]:
            tb = [d[f"{key}_us"] and d["torch_bf16_us"] / d[f"{key}_us"] for d in ds
                  if f"{key}_us" in d and "torch_bf16_us" in d]  # fmt: skip
            if tb:
                targets[f"m{m}_{key}_geomean_x_torch_bf16"] = _geo(tb)
            vals = [d[f"{key}_x_bf16"] for d in ds if f"{key}_x_bf16" in d]
            if vals:
                targets[f"m{m}_{key}_geomean_x_bf16"] = _geo(vals)
                targets[f"m{m}_{key}_shapes"] = len(vals)
    return derived, targets


def _write(path, result):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="experiments/results/bench_kernel_gemm.json")
    ap.add_argument("--ms", default="8,16,32,64,128,256")
    ap.add_argument("--shapes", default="all", help="'all' or N:K,N:K,...")
    ap.add_argument(
        "--variants",
        default="gemm,gemm_kt256,gemm_wm2,gemm_cluster",
        help=f"of {sorted({**VARIANTS, **WGMMA_VARIANTS})}",
    )
    ap.add_argument(
        "--ops", default=",".join(CORE_OPS + tuple(o for o in EXTRA_OPS if o != "dot_kernel"))
    )
    ap.add_argument("--old-ms", default="16,64,256")
    ap.add_argument("--jit-ms", default="64")
    ap.add_argument("--time-budget", type=float, default=1e9, help="seconds; later work skipped")
    args = ap.parse_args()
    ms = [int(v) for v in args.ms.split(",")]
    variants = args.variants.split(",")
    known = {**VARIANTS, **WGMMA_VARIANTS}
    for v in variants:
        if v not in known:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(known)}")
    ops = set(args.ops.split(","))
    old_ms = {int(v) for v in args.old_ms.split(",") if v}
    jit_ms = {int(v) for v in args.jit_ms.split(",") if v}
    shapes = (
        unique_shapes()
        if args.shapes == "all"
        else [tuple(int(a) for a in s.split(":")) for s in args.shapes.split(",")]
    )
    import jax
    import jax.numpy as jnp
    import torch

    from cuda_ops import nvfp4_gemm
    from rejax.ops import _dispatch

    bk.LAYER0 = jnp.zeros((), jnp.int32)
    t_start = time.time()
    problems = [
        {"m": m, "n": n, "k": k, "options": _options(v)}
        for n, k in shapes
        for m in ms
        for v in variants
        if m in VARIANT_MS.get(v, {m}) and v not in WGMMA_VARIANTS
    ]
    nvfp4_gemm.prebuild(problems)
    wgmma_plans = [
        _wgmma_plan(v, m, n, k)
        for n, k in shapes
        for m in ms
        for v in variants
        if v in WGMMA_VARIANTS and m in VARIANT_MS[v]
    ]
    if wgmma_plans:
        from cuda_ops import nvfp4_gemm_wgmma as wgm

        wgm.prebuild(wgmma_plans)
    result = {
        "versions": bk._versions(torch),
        "device": str(jax.devices()[0]),
        "launch": _dispatch.default_launch(),
        "method": __doc__,
        "variants": {v: known[v] for v in variants},
        "prebuild_s": time.time() - t_start,
        "copy_bw_Bps": bk.copy_bandwidth(torch),
    }
    print(
        "prebuild", result["prebuild_s"], "s; copy bandwidth", result["copy_bw_Bps"] / 1e12, "TB/s"
    )
    # the kernels and baselines at every M over every shape first, then the jitted extras
    extra_ms = [m for m in ms if m in old_ms | jit_ms]
    passes = [(ms, ops & set(CORE_OPS)), (extra_ms, ops & set(EXTRA_OPS))]
    by_key, skipped = {}, []
    for pass_ms, pass_ops in passes:
        for n, k in shapes:
            if not pass_ms or not pass_ops:
                continue
            if time.time() - t_start > args.time_budget:
                skipped.append({"n": n, "k": k, "ms": pass_ms, "ops": sorted(pass_ops)})
                continue
            for row in bench_shape(torch, n, k, pass_ms, pass_ops, variants, old_ms, jit_ms):
                by_key.setdefault((n, k, row["m"]), {}).update(row)
            rows = list(by_key.values())
            _write(args.out, {**result, "rows": rows, "partial": True})  # survives a timeout
    rows = list(by_key.values())
    result["rows"], result["skipped_for_time"] = rows, skipped
    result["derived"], result["targets"] = summarize(rows, result["copy_bw_Bps"], variants)
    result["layer_map"] = [
        {"model": mo, "layer": la, "n": n, "k": k} for mo, la, n, k in all_shapes()
    ]
    result["wall_s"] = time.time() - t_start
    _write(args.out, result)
    print(json.dumps(result["targets"], indent=1))
    print(f"{'N x K':>13} {'M':>3} {'best':>12} {'us':>7} {'%copy':>6} {'x bf16':>7} {'gemv us':>8}"
          f" {'old x':>6} {'jit us':>7}")  # fmt: skip
    for d in sorted(result["derived"], key=lambda d: (d["m"], d["n"], d["k"])):
        print(
            f"{d['n']:>6}x{d['k']:<6} {d['m']:>3} {d.get('best_variant', '-'):>12} "
            f"{d.get('best_us', math.nan):7.2f} {d.get('best_pct_copy_bw', math.nan):6.1f} "
            f"{d.get('best_x_bf16', math.nan):7.2f} {d.get('gemv_graph_us', math.nan):8.2f} "
            f"{d.get('old_path_x_bf16', math.nan):6.2f} {d.get('gemm_jit_us', math.nan):7.2f}"
        )
    if skipped:
        print("skipped for time:", skipped)


if __name__ == "__main__":
    main()
