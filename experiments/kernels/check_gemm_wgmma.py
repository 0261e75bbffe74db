"""EXPERIMENT (device): the wgmma NVFP4 W4A4 GEMM (cuda_ops/nvfp4_gemm_wgmma.cu)
checked against production and timed, on an H200. From the repository root:

    PYTHONPATH=. python3 experiments/kernels/check_gemm_wgmma.py --out $OUT/wgmma.json

1. Builds the wgmma variants (`VARIANTS`) and the production GEMM (its default plan) for the
   Qwen3-8B shapes N x K = 6144x4096, 4096x4096, 24576x4096, 4096x12288 at M = 16, 32, 64 (or
   --ms), plus extra cases (`EXTRA`: an M that pads its token tile, tiny block scales that make
   the decoded fp16 weights subnormal, M = 200 for each 128 / 256-token-tile variant, and
   N = 4000 for each BULK variant).
   Large M, e.g. `--ms 128,256 --variants wgmma_n128,wgmma_n128_wr2,wgmma_n128_s1,wgmma_n256`.
2. Runs every kernel on random NVFP4 weights and activations (uniform codes, E4M3 block scales
   0.125 .. 240 as tests/test_gemm_gpu.py) into NaN-poisoned outputs, twice (bitwise
   repeatable), and compares with the float64 product of the same dequantized operands (relative
   Frobenius error <= 1.5 x that of float64 merely rounded to bf16, + 1e-6: the GPU tests'
   bound), with production (relative Frobenius difference, fraction of bitwise-equal bf16
   outputs: only the fp32 summation order differs, so expect near-equality) and with the pure-JAX
   reference rejax.nvfp4.nvfp4_matmul_q (the same two numbers). A wgmma failure also runs the
   DESC_SWAP diagnostic build (the descriptor's LBO and SBO exchanged) and records whether that
   one passes.
3. Times each kernel alone as experiments/bench_gemm.py does (a CUDA graph of direct launches
   over enough weight copies to read > 256 MiB, CUDA events, median of 25 replays after warm-up)
   and the jitted bf16 dot over bf16 weight copies (host clock), the benchmark's baseline.
4. Writes one JSON to --out (versions and git sha, device, NVRTC, plans, offline ptxas registers /
   spills / wgmma serialization warnings and the driver JIT's registers, rows, timings, summary)
   and exits 1 if any correctness check failed (after writing the JSON).

The CPU-only parts (`problems`, the plans) import without a GPU: experiments/tests/
test_gemm_wgmma.py compiles every planned kernel with NVRTC.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cuda_ops import nvfp4_gemm_wgmma as wgm

# name -> wgm.plan keyword options; "wgmma" is the plan's default
VARIANTS = {
    "wgmma": {},
    # two warpgroups of one 64-row tile each: production's tile rows at M > 16 with 8 warps of
    # about half the registers (more warps per SM to hide the decode); capped at 128 registers
    # so that two CTAs of 256 threads fit an SM (ptxas: 74 / 79 / 128 at M = 16 / 32 / 64)
    "wgmma_wg2": {"nwg": 2, "wr": 1, "min_blocks": 2},
    # opt-in (--variants): 256-element stages
    "wgmma_kt256": {"kt": 256},
    # opt-in, for M >= 128 (prefill, [T2-C]'s M = 256): 128 / 256 tokens a tile, each weight
    # decoded once per tile (production's 64-token tiles decode it M / 64 times), two
    # warpgroups sharing the x tile, one CTA per SM, K split only to fill one wave
    "wgmma_n128": {"tm": 128, "nwg": 2, "wr": 1},
    "wgmma_n128_wr2": {"tm": 128, "nwg": 2, "wr": 2},
    "wgmma_n128_s1": {"tm": 128, "nwg": 2, "wr": 1, "splitk": 1},
    "wgmma_n256": {"tm": 256, "nwg": 2, "wr": 1},
    # the stage copies as first written (loops from each thread's index, not unrolled)
    "wgmma_n128_loop": {"tm": 128, "nwg": 2, "wr": 1, "static_copies": False},
    # longer commit groups (fewer waits a MAC, more A registers): all 4 code words of a stage
    # (8 k16 steps) with one and with two tiles a warpgroup (ptxas sm_90a: 168 / 241
    # registers, no spills; one warpgroup arrive and wait a stage instead of four). A stage is
    # then one commit group: one tile a warpgroup unrolls the stage loop by two (two register
    # sets, the previous stage's group in flight), two tiles wait for their own group at the
    # end of each stage (the kernel's one_group_stage; the first build rewrote the A registers
    # of an in-flight group)
    "wgmma_n128_g4": {"tm": 128, "nwg": 2, "wr": 1, "group_words": 4},
    "wgmma_n128_wr2_g4": {"tm": 128, "nwg": 2, "wr": 2, "group_words": 4},
    # BULK 1: pre-tiled operands, each ring slot filled by three bulk copies from thread 0 on a
    # "full" mbarrier, slots handed back through "empty" mbarriers, no block barrier (ptxas
    # sm_90a at 6144 x 4096, M = 256: 122 / 218 registers, no spills, no serialization).
    # H100, M = 256: 1.93x / 1.80x production (experiments/results/wgmma_bulk_h100/)
    "wgmma_n128_bulk": {"tm": 128, "nwg": 2, "wr": 1, "bulk": 1},
    "wgmma_n128_wr2_bulk": {"tm": 128, "nwg": 2, "wr": 2, "bulk": 1},
    "wgmma_n128_wr2_g4_bulk": {"tm": 128, "nwg": 2, "wr": 2, "group_words": 4, "bulk": 1},
    # BULK 3: x_hat pre-tiled (one bulk copy), the weights by cp.async from every thread as
    # BULK 0 does, all on the stage's mbarrier (no repack, no block barrier)
    "wgmma_n128_xb": {"tm": 128, "nwg": 2, "wr": 1, "bulk": 3},
    # ... with the K split that leaves the least of the last wave idle (`wave_splitk`; not yet
    # run): e.g. N = 5120 at M = 256, 80 tiles on 132 SMs, split 3 instead of 1
    "wgmma_n128_xb_wave": {"tm": 128, "nwg": 2, "wr": 1, "bulk": 3, "split_rule": "wave"},
    "wgmma_n128_wr2_xb": {"tm": 128, "nwg": 2, "wr": 2, "bulk": 3},
    # the model's, with two commit groups in flight inside a stage (PIPE 2; changed nothing on
    # an H100: experiments/results/dot_x_h100/)
    "wgmma_n128_xb_p2": {"tm": 128, "nwg": 2, "wr": 1, "bulk": 3, "pipe": 2},
    "wgmma_n128_wr2_xb_p2": {"tm": 128, "nwg": 2, "wr": 2, "bulk": 3, "pipe": 2},
    # 256-token tiles with BULK 3 (each weight decoded once per 256 tokens; 3 stages of 73 KB,
    # one loaded ahead; ptxas 186 registers; the model's tm "auto" where it fills waves)
    "wgmma_n256_xb": {"tm": 256, "nwg": 2, "wr": 1, "bulk": 3},
    "wgmma_n256_xb_p2": {"tm": 256, "nwg": 2, "wr": 1, "bulk": 3, "pipe": 2},
    # ... and the CTAs walking groups of token tiles (RASTER: 8 of 128 tokens, 4 of 256), so
    # the CTAs resident at once share about 1024 tokens' x_hat in L2 (M in the thousands: the
    # batch-8 prefill's 4096 rows; the same tiles and bits as without; H100 at 4096 rows: 0.80
    # and 0.95x jitted bf16 against 0.77 and 0.90 without, experiments/results/
    # wgmma_prefill_h100_s45/)
    "wgmma_n128_xb_r8": {"tm": 128, "nwg": 2, "wr": 1, "bulk": 3, "raster": 8},
    "wgmma_n256_xb_r4": {"tm": 256, "nwg": 2, "wr": 1, "bulk": 3, "raster": 4},
    "wgmma_xb": {"bulk": 3},
    # the plan's own small-M tiles (8-64 tokens) with the bulk forms
    "wgmma_bulk": {"bulk": 1},
}
LARGE_M_VARIANTS = (
    "wgmma_n128",
    "wgmma_n128_wr2",
    "wgmma_n128_s1",
    "wgmma_n256",
    "wgmma_n128_loop",
    "wgmma_n128_g4",
    "wgmma_n128_wr2_g4",
    "wgmma_n128_bulk",
    "wgmma_n128_wr2_bulk",
    "wgmma_n128_wr2_g4_bulk",
    "wgmma_n128_xb",
    "wgmma_n128_wr2_xb",
    "wgmma_n128_xb_wave",
    "wgmma_n128_xb_p2",
    "wgmma_n128_wr2_xb_p2",
    "wgmma_n256_xb",
    "wgmma_n256_xb_p2",
    "wgmma_n128_xb_r8",
    "wgmma_n256_xb_r4",
)
DEFAULT_VARIANTS = ("wgmma", "wgmma_wg2")
# (tag, n, k, m, scale byte range, weight global scale factor): correctness only
EXTRA = (
    ("odd_m", 4096, 4096, 40, (0x20, 0x78), 1.0),
    ("subnormal", 1024, 2048, 16, (0x01, 0x18), 1e3),
    ("odd_m_large", 4096, 4096, 200, (0x20, 0x78), 1.0),  # the large-tile variants only
    # the BULK variants only, M = 40 or 256 by tile: N not a multiple of any weight tile (the
    # last tile's rows past N: BULK 1's zero padding, BULK 3's zero-filled copies)
    ("odd_n", 4000, 4096, None, (0x20, 0x78), 1.0),
)
DEFAULT_SCALES = (0x20, 0x78)
LUT = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])


def problems(shapes=wgm.QWEN3_8B_SHAPES, ms=wgm.CHECK_MS, variants=DEFAULT_VARIANTS) -> list:
    """Every (tag, variant, plan) the check builds: the shapes at every M per variant, then the
    extra cases with the default variant. CPU only."""
    out = []
    for n, k in shapes:
        for m in ms:
            for v in variants:
                out.append(("model", v, wgm.plan(m, n, k, **VARIANTS[v])))
    for tag, n, k, m, _, _ in EXTRA[:2]:
        out.append((tag, "wgmma", wgm.plan(m, n, k)))
    # a token count that pads the large tiles, for each large-tile variant asked for
    for v in variants:
        large = VARIANTS[v].get("tm", 0) >= 128
        if large:
            out.append(("odd_m_large", v, wgm.plan(200, 4096, 4096, **VARIANTS[v])))
        if VARIANTS[v].get("bulk"):
            out.append(("odd_n", v, wgm.plan(256 if large else 40, 4000, 4096, **VARIANTS[v])))
    return out


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 2**31


def _plan_dict(p) -> dict:
    keys = ("tm", "wr", "nwg", "kt", "stages", "splitk")
    return {
        **{k: getattr(p, k) for k in keys},
        "grid": p.grid,
        "threads": p.threads,
        "smem": p.smem,
    }


# ----------------------------------------------------------------------------- device parts


class _Ctx:
    """Imports and device state shared by the checks (built in main)."""

    def __init__(self):
        import jax
        import jax.numpy as jnp
        import torch

        from cuda_ops import nvfp4_gemm
        from experiments import bench_gemm
        from experiments import bench_kernel as bk
        from rejax import nvfp4
        from rejax.ops import linear

        self.jax, self.jnp, self.torch = jax, jnp, torch
        self.nvfp4_gemm, self.bench_gemm, self.bk, self.nvfp4 = nvfp4_gemm, bench_gemm, bk, nvfp4
        self.x_prod = jax.jit(linear.gemm_x_operand)
        self.x_wgmma = jax.jit(wgm.wgmma_x_operand)
        self.layer0 = jnp.zeros((), jnp.int32)
        self.lut = torch.tensor(LUT, dtype=torch.float64, device="cuda")
        self.diagnostics_left = 4  # DESC_SWAP builds after failures (each costs a compile)


def _values64(c: _Ctx, p: np.ndarray, s: np.ndarray):
    """codes [R, K/2] and scale bytes [R, K/16] (host) -> e2m1 * SF, float64 [R, K] (GPU)."""
    torch = c.torch
    pt = torch.from_numpy(p).cuda().long()
    codes = torch.stack([pt & 15, pt >> 4], -1).reshape(p.shape[0], -1)
    v = c.lut[codes].reshape(p.shape[0], -1, 16)
    sf = torch.from_numpy(s).cuda().view(torch.float8_e4m3fn).double()[..., None]
    return (v * sf).reshape(p.shape[0], -1)


def _run(c: _Ctx, kernel, ptrs, m, n):
    """Direct launch into a NaN-poisoned output (and workspace): (y bf16 torch [M, N], written)."""
    torch = c.torch
    y = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    work = None
    if kernel.plan.partials:
        work = torch.full(kernel.plan.out_shape, float("nan"), dtype=torch.float32, device="cuda")
    kernel.launch(
        torch.cuda.current_stream().cuda_stream,
        [*ptrs, y.data_ptr()],
        None if work is None else work.data_ptr(),
    )
    torch.cuda.synchronize()
    written = bool(torch.isfinite(y).all()) and (work is None or bool(torch.isfinite(work).all()))
    return y, written


def _cmp(c: _Ctx, a, b) -> dict:
    """a vs b (bf16 torch [M, N]): relative Frobenius difference and bitwise-equal fraction."""
    torch = c.torch
    diff = float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))
    eq = float((a.view(torch.int16) == b.view(torch.int16)).double().mean())
    return {"rel_diff": diff, "frac_bitwise_equal": eq}


def _rel(c: _Ctx, a, ref64) -> float:
    torch = c.torch
    return float(torch.linalg.norm(a.double() - ref64) / torch.linalg.norm(ref64))


class _Weights:
    """One random NVFP4 weight on host and device (+ its float64 dequantization on the GPU)."""

    def __init__(self, c: _Ctx, n, k, scales, gw_factor, seed):
        rng = np.random.default_rng(seed)
        self.wp = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
        self.ws = rng.integers(scales[0], scales[1], (n, k // 16), dtype=np.uint8)
        self.gw = np.float32((rng.random() * 1e-3 + 1e-4) * gw_factor)
        jnp = c.jnp
        self.d = (jnp.asarray(self.wp), jnp.asarray(self.ws), jnp.asarray(self.gw))
        self.w64 = _values64(c, self.wp, self.ws) * float(self.gw)


def check_case(c: _Ctx, tag, n, k, m, w: _Weights, kernels: dict, seed) -> tuple[dict, list]:
    """All kernels of one (N, K, M) against float64, production and the JAX reference."""
    jax, jnp, torch = c.jax, c.jnp, c.torch
    rng = np.random.default_rng(seed)
    xp = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    xs = rng.integers(0x20, 0x78, (m, k // 16), dtype=np.uint8)
    xg = (rng.random(m) * 1e-2 + 1e-3).astype(np.float32)
    xp_d, xs_d, xg_d = jnp.asarray(xp), jnp.asarray(xs), jnp.asarray(xg)
    xh_prod = jax.block_until_ready(c.x_prod(xp_d, xs_d))
    xh_wg = jax.block_until_ready(c.x_wgmma(xp_d, xs_d))
    x64 = _values64(c, xp, xs) * torch.from_numpy(xg).cuda().double()[:, None]
    y64 = x64 @ w.w64.T
    floor = _rel(c, y64.to(torch.bfloat16), y64)
    bound = 1.5 * floor + 1e-6
    wp_d, ws_d, wg_d = w.d
    # raw pointers go to launches on torch's stream, which does not wait for JAX's transfers
    jax.block_until_ready((xp_d, xs_d, xg_d, wp_d, ws_d, wg_d, c.layer0))
    tail = [
        wp_d.unsafe_buffer_pointer(),
        ws_d.unsafe_buffer_pointer(),
        wg_d.unsafe_buffer_pointer(),
        c.layer0.unsafe_buffer_pointer(),
    ]

    def ptrs(xh):
        return [xh.unsafe_buffer_pointer(), xg_d.unsafe_buffer_pointer(), *tail]

    def kernel_ptrs(kern):
        """The wgmma kernel's operands: BULK ones pre-tiled (kept alive in `keep`)."""
        if not kern.plan.bulk:
            return ptrs(xh_wg)
        xt, (tp, ts) = bulk_operands(c, kern.plan, xh_wg, (wp_d, ws_d))
        keep.append((xt, tp, ts))
        return [
            xt.unsafe_buffer_pointer(),
            xg_d.unsafe_buffer_pointer(),
            tp.unsafe_buffer_pointer(),
            ts.unsafe_buffer_pointer(),
            *tail[2:],
        ]

    keep = []

    e4m3 = jnp.float8_e4m3fn
    xq = c.nvfp4.Nvfp4Tensor(
        packed=xp_d,
        scales=jax.lax.bitcast_convert_type(xs_d, e4m3),
        global_scale=xg_d,
        shape=(m, k),
    )
    wq = c.nvfp4.Nvfp4Tensor(
        packed=wp_d,
        scales=jax.lax.bitcast_convert_type(ws_d, e4m3),
        global_scale=wg_d,
        shape=(n, k),
    )
    y_ref = torch.from_numpy(np.array(c.nvfp4.nvfp4_matmul_q(xq, wq)).view(np.int16))
    y_ref = y_ref.cuda().view(torch.bfloat16)

    row = {
        "tag": tag,
        "n": n,
        "k": k,
        "m": m,
        "bf16_floor": floor,
        "bound": bound,
        "jax_ref_err": _rel(c, y_ref, y64),
    }
    failures = []
    prod = kernels["production"]
    y_prod, ok = _run(c, prod, ptrs(xh_prod), m, n)
    row["production"] = {
        "err": _rel(c, y_prod, y64),
        "written": ok,
        "vs_jax_ref": _cmp(c, y_prod, y_ref),
    }
    if not ok or row["production"]["err"] > bound:
        failures.append((tag, n, k, m, "production", "failed its own float64 bound"))
    for name, kern in kernels.items():
        if name == "production":
            continue
        kp = kernel_ptrs(kern)
        y1, ok1 = _run(c, kern, kp, m, n)
        y2, _ = _run(c, kern, kp, m, n)
        r = {
            "plan": _plan_dict(kern.plan),
            "err": _rel(c, y1, y64),
            "written": ok1,
            "repeatable": bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16))),
            "vs_production": _cmp(c, y1, y_prod),
            "vs_jax_ref": _cmp(c, y1, y_ref),
        }
        why = None
        if not ok1:
            why = "unwritten or non-finite outputs"
        elif not r["repeatable"]:
            why = "not bitwise repeatable"
        elif r["err"] > bound:
            why = f"rel err {r['err']:.3e} > bound {bound:.3e}"
        r["passed"] = why is None
        if why:
            failures.append((tag, n, k, m, name, why))
        if why and kern.plan.tm >= 128:
            # the swapped strides step 8-token groups by X_COL = TM x 16 bytes: from TM = 128
            # they read past the shared-memory ring (an illegal address that ends the process)
            r["desc_swap_skipped"] = f"TM={kern.plan.tm}: the swapped strides leave the ring"
        elif why and c.diagnostics_left > 0:
            c.diagnostics_left -= 1
            try:  # the descriptor diagnostic: does the LBO / SBO exchange fix it?
                swap = wgm.build_plan(dataclasses.replace(kern.plan, desc_swap=True))
                ys, oks = _run(c, swap, kp, m, n)
                r["desc_swap_err"] = _rel(c, ys, y64) if oks else None
                r["desc_swap_passes"] = bool(oks and r["desc_swap_err"] <= bound)
            except Exception as err:  # noqa: BLE001
                r["desc_swap_error"] = f"{type(err).__name__}: {err}"[:300]
        row[name] = r
    return row, failures


def bulk_operands(c: _Ctx, p, xh_wg, weight):
    """A BULK plan's operands from the plain ones: the wgmma-order x_hat as stage tiles, and
    with BULK 1 the weight codes and scales as weight stage tiles (BULK 3 reads them as they
    are; cuda_ops/nvfp4_gemm_wgmma.py)."""
    xt = wgm.to_stage_tiles(xh_wg, p.tm, p.kt)
    tiles = wgm.weight_stage_tiles(*weight, p.tile_n, p.kt) if p.bulk == 1 else tuple(weight)
    return c.jax.block_until_ready((xt, tiles))


def weight_copies(jax, n, k, copies, with_bf16):
    """Distinct random NVFP4 weights (codes [N, K/2], scale bytes [N, K/16]) for `copies`
    launches that together read past L2, the bf16 weights of the baseline (enough copies of
    their own, or None) and the key left for the activations."""
    import jax.numpy as jnp

    from experiments import bench_kernel as bk

    kw, ks, kx = jax.random.split(jax.random.PRNGKey(n * 7 + k), 3)
    weights = [
        (
            jax.random.randint(jax.random.fold_in(kw, i), (n, k // 2), 0, 256, jnp.int32).astype(
                jnp.uint8
            ),
            jax.random.randint(
                jax.random.fold_in(ks, i), (n, k // 16), 0x20, 0x78, jnp.int32
            ).astype(jnp.uint8),
        )
        for i in range(copies)
    ]
    wbf = None
    if with_bf16:
        wbf = [
            jax.random.normal(jax.random.fold_in(kw, 1000 + i), (n, k), jnp.bfloat16) * 0.02
            for i in range(bk._copies(2 * n * k))
        ]
    return weights, wbf, kx


def time_shape(c: _Ctx, n, k, ms, kernels_by_m: dict, with_bf16: bool) -> list:
    """Kernel-alone times (CUDA graph over weight copies) of every kernel at every M, and the
    jitted bf16 dot, as experiments/bench_gemm.py."""
    jax, jnp, torch, bk = c.jax, c.jnp, c.torch, c.bk
    nv_bytes = n * k // 2 + n * k // 16
    c_nv = bk._copies(nv_bytes)
    weights, wbf, kx = weight_copies(jax, n, k, c_nv, with_bf16)
    wg = jnp.float32(1e-3)
    rows = []
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
        xq = c.nvfp4.quantize_activation(x)
        xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
        xg = jnp.asarray(xq.global_scale, jnp.float32)
        xh = {
            "production": jax.block_until_ready(c.x_prod(xq.packed, xs)),
            "wgmma": jax.block_until_ready(c.x_wgmma(xq.packed, xs)),
        }
        row = {"n": n, "k": k, "m": m, "nvfp4_bytes": nv_bytes, "copies": c_nv}
        for name, kern in kernels_by_m[m].items():
            operand = xh["production" if name == "production" else "wgmma"]
            wcopies = weights
            try:
                if name != "production" and kern.plan.bulk:  # pre-tiled operands, same bytes
                    tiled = [bulk_operands(c, kern.plan, operand, w) for w in weights]
                    operand, wcopies = tiled[0][0], [t[1] for t in tiled]
                row[f"{name}_us"] = 1e6 * c.bench_gemm.time_gemm_graph(
                    torch, kern, operand, xg, wcopies, wg, c.layer0
                )
            except Exception as err:  # noqa: BLE001
                row[f"{name}_error"] = f"{type(err).__name__}: {err}"[:300]
            del wcopies
        if wbf is not None:
            f = jax.jit(lambda ws, x=x: [jnp.dot(x, w.T) for w in ws])
            row["bf16_us"] = 1e6 * bk.time_jax(f, (wbf,), len(wbf), calls=5, trials=5)
        for name in kernels_by_m[m]:
            if f"{name}_us" in row and "bf16_us" in row:
                row[f"{name}_x_bf16"] = row["bf16_us"] / row[f"{name}_us"]
            if name != "production" and f"{name}_us" in row and "production_us" in row:
                row[f"{name}_speedup_vs_production"] = row["production_us"] / row[f"{name}_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del weights, wbf
    return rows


def _geo(values):
    return float(np.exp(np.mean(np.log(values)))) if values else None


def summarize(timing: list, names: list) -> dict:
    out = {}
    for m in sorted({r["m"] for r in timing}):
        rs = [r for r in timing if r["m"] == m]
        for name in names:
            vals = [r[f"{name}_x_bf16"] for r in rs if f"{name}_x_bf16" in r]
            if vals:
                out[f"m{m}_{name}_geomean_x_bf16"] = _geo(vals)
            sp = [
                r[f"{name}_speedup_vs_production"]
                for r in rs
                if f"{name}_speedup_vs_production" in r
            ]
            if sp:
                out[f"m{m}_{name}_geomean_speedup_vs_production"] = _geo(sp)
    return out


def print_table(timing: list, names) -> None:
    """The timing rows as a table: N x K, M, each kernel's us, the bf16 dot's us."""
    print(
        f"{'N x K':>13} {'M':>3} "
        + " ".join(f"{n + ' us':>16}" for n in names)
        + f" {'bf16 us':>8}"
    )
    for r in timing:
        cells = " ".join(f"{r.get(f'{n}_us', math.nan):16.2f}" for n in names)
        print(f"{r['n']:>6}x{r['k']:<6} {r['m']:>3} {cells} {r.get('bf16_us', math.nan):8.2f}")


def _write(path, result):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


def _check_and_time(args, c, t0, ms, variants, todo, result, failures, skipped) -> None:
    """Phases 2 and 3 of main: correctness rows, then timings (appended to `result`)."""
    build_s = result["build_s"]
    # 2. correctness
    by_shape: dict = {}
    for tag, v, p in todo:
        by_shape.setdefault((tag, p.n, p.k, p.m), {})[v] = wgm.build_plan(p)
    weights: dict = {}
    for (tag, n, k, m), kerns in by_shape.items():
        extra = {e[0]: e for e in EXTRA}.get(tag)
        scales, gw_factor = (extra[4], extra[5]) if extra else (DEFAULT_SCALES, 1.0)
        wkey = (n, k, scales, gw_factor)
        if wkey not in weights:
            weights.clear()  # one weight on the GPU at a time
            weights[wkey] = _Weights(c, n, k, scales, gw_factor, _seed("w", *wkey))
        kernels = {"production": c.nvfp4_gemm.build(m, n, k), **kerns}
        row, fails = check_case(c, tag, n, k, m, weights[wkey], kernels, _seed("x", tag, n, k, m))
        row["production"]["plan"] = {
            "splitk": kernels["production"].plan.splitk,
            "wr": kernels["production"].plan.wr,
            "tm": kernels["production"].plan.tm,
        }
        result["rows"].append(row)
        failures.extend(fails)
        brief = {
            name: (row[name]["err"], row[name].get("vs_production", {}).get("frac_bitwise_equal"))
            for name in kernels
        }
        print(
            json.dumps(
                {
                    "tag": tag,
                    "n": n,
                    "k": k,
                    "m": m,
                    "bound": row["bound"],
                    "err, frac_eq_prod": brief,
                }
            ),
            flush=True,
        )
        _write(args.out, {**result, "partial": True})
    weights.clear()
    c.torch.cuda.empty_cache()
    result["correctness_s"] = time.time() - t0 - build_s

    # 3. timing
    if not args.no_time:
        # largest first: gate_up (24576 x 4096) is the shape of experiments/KERNEL_NOTES.md
        for n, k in sorted(wgm.QWEN3_8B_SHAPES, key=lambda s: -s[0] * s[1]):
            if time.time() - t0 > args.time_budget:
                skipped.append([n, k])
                continue
            kernels_by_m = {
                m: {"production": c.nvfp4_gemm.build(m, n, k), **by_shape[("model", n, k, m)]}
                for m in ms
            }
            result["timing"] += time_shape(c, n, k, ms, kernels_by_m, not args.no_bf16)
            _write(args.out, {**result, "partial": True})


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--ms", default=",".join(map(str, wgm.CHECK_MS)))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--no-bf16", action="store_true", help="skip the jitted bf16 baseline")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=125.0,
        help="seconds since start after which the remaining timings are skipped",
    )
    args = ap.parse_args(argv)
    t0 = time.time()
    ms = [int(v) for v in args.ms.split(",")]
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    c = _Ctx()
    from cuda_ops import build as cbuild

    # 1. build (NVRTC in threads), production with its default plan
    todo = problems(wgm.QWEN3_8B_SHAPES, ms, variants)
    wgm.prebuild([p for _, _, p in todo])
    prod_problems = [{"m": p.m, "n": p.n, "k": p.k} for _, v, p in todo if v == variants[0]]
    c.nvfp4_gemm.prebuild(prod_problems)
    build_s = time.time() - t0
    print(
        f"built {len(todo)} wgmma + {len(prod_problems)} production kernels in {build_s:.1f} s",
        flush=True,
    )
    result = {
        "versions": c.bk._versions(c.torch),
        "device": str(c.jax.devices()[0]),
        "nvrtc": ".".join(map(str, cbuild.nvrtc_version())),
        "method": __doc__,
        "variants": {v: VARIANTS[v] for v in variants},
        "build_s": build_s,
        "ptxas": [],
        "rows": [],
        "timing": [],
    }
    # the driver JIT's registers of every wgmma kernel, offline ptxas (registers, spills, wgmma
    # serialization warnings) of the default variant's
    for tag, v, p in todo:
        kern = wgm.build_plan(p)
        rep = {"tag": tag, "variant": v, "m": p.m, "n": p.n, "k": p.k, "plan": _plan_dict(p)}
        try:
            rep["driver"] = kern.attributes()
            if v == variants[0]:
                rep["ptxas"] = wgm.ptxas_report(p)
        except Exception as err:  # noqa: BLE001
            rep["error"] = f"{type(err).__name__}: {err}"[:300]
        result["ptxas"].append(rep)

    _write(args.out, {**result, "partial": True})  # before the first launch
    failures, skipped = [], []
    try:
        _check_and_time(args, c, t0, ms, variants, todo, result, failures, skipped)
    except Exception:  # noqa: BLE001 (a kernel fault poisons the context: record, then fail)
        import traceback

        result["exception"] = traceback.format_exc()[-4000:]
        failures.append(("exception", traceback.format_exc().splitlines()[-1]))
    result["skipped_for_time"] = skipped
    result["summary"] = summarize(result["timing"], ["production", *variants])
    result["failures"] = [list(f) for f in failures]
    result["passed"] = not failures
    result["wall_s"] = time.time() - t0
    _write(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    print_table(result["timing"], ["production", *variants])
    if failures:
        print("CORRECTNESS FAILED:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"passed, {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
