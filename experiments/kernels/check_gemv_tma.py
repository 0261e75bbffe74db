"""EXPERIMENT (device): the TMA-streamed batch-1 NVFP4 W4A4 GEMV
(experiments/kernels/nvfp4_gemv_tma.cu) checked against production and float64, and timed
against production's M = 1 GEMV and the plain read floor. From the repository root:

    PYTHONPATH=. python3 experiments/kernels/check_gemv_tma.py --out $OUT/gemv_tma.json

1. Per Qwen3-8B layer shape (N x K = 6144x4096, 4096x4096, 24576x4096, 4096x12288) and per
   variant (`VARIANTS`: stage size and count, CTAs per SM, rows a stage, an L2 evict_first
   policy, the cp.async producer, and the NOMATH diagnostic), builds the kernel (NVRTC) and
   production's plain W4A4 GEMV at M = 1 (its default plan, cuda_ops.nvfp4_gemv.build); then
   the residual epilogue (y = res + y) on o_proj's and down_proj's shapes and a weight stacked 3
   deep read at layer 2 (plain and residual, correctness only), and gate_up's SwiGLU epilogue
   (down_proj's NVFP4 input, production's SWIGLU_OUT), with `RESIDUAL_VARIANTS`. Both kernels
   take the same operands (production's: xp, xs, xg, [res], wp, ws, wg, layer[, xgd]).
2. Runs each on random NVFP4 operands (uniform codes, E4M3 block scales 0.125 .. 240 as the
   GPU tests use) into NaN-poisoned outputs, twice (bitwise repeatable), and compares with the
   float64 product of the same dequantized operands (relative error <= 1.5 x that of float64
   merely rounded to bf16, + 1e-6: the GPU tests' bound) and with production (relative
   difference and the fraction of bitwise-equal bf16 outputs: only the fp32 summation order
   differs). NOMATH computes nothing and is only timed.
3. Times each kernel alone: one CUDA graph of direct launches over enough weight copies to read
   > 256 MiB (experiments/bench_kernel.py's rotation), CUDA events, median of 25 replays after
   warm-up; and the plain read floor of the same bytes at 4 and 1 CTAs of 512 threads per SM
   (bench_kernel.time_read_floor_graph), the device copy bandwidth once.
4. Writes one JSON to --out (versions, git sha from --git-sha, plans, offline ptxas registers
   and spills, the driver's registers, rows, timings and a summary: per shape and variant the
   time against production's) and exits 1 if a correctness check failed (after writing it).

The CPU-only parts (`problems`, the plans) import without a GPU: experiments/tests/
test_gemv_tma.py compiles every planned kernel with NVRTC and ptxas.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import zlib

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from cuda_ops.build import KernelError
from experiments.kernels import nvfp4_gemv_tma as tma

# name -> nvfp4_gemv_tma.plan keyword options
VARIANTS = {
    "tma": {},  # 1024-byte row chunks, 6 stages (110 KB of weights in flight a CTA)
    "tma_s8": {"stages": 8},
    "tma_k2048_s4": {"kch": 2048, "stages": 4},
    "tma_c2_s4": {"ctas": 2, "stages": 4},  # two CTAs an SM, 74 KB in flight each
    "tma_w8_s12": {"warps": 8, "stages": 12},  # 8 rows a stage: finer row groups
    "tma_ef": {"ef": True},
    "lsu": {"producer": "lsu"},  # the second design: the ring filled by cp.async, not TMA
    "lsu_c2_s4": {"producer": "lsu", "ctas": 2, "stages": 4},
    "tma_nomath": {"nomath": True},  # diagnostic: the stream alone
}
TIMED_ONLY = ("tma_nomath",)
RESIDUAL_VARIANTS = ("tma", "lsu")  # the residual epilogue and the stacked-layer case
LUT = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
SCALES = (0x20, 0x78)  # E4M3 bytes 0.125 .. 240
DEFAULT_SHAPES = ",".join(f"{n}x{k}" for n, k in tma.QWEN3_8B_SHAPES)
DEVICE = "cuda"  # the torch device of every buffer (the CPU test runs the harness on "cpu")


def problems(shapes=tma.QWEN3_8B_SHAPES, variants=tuple(VARIANTS)) -> list:
    """Every (variant, plan) the check builds (RESIDUAL_VARIANTS also with the residual and the
    SwiGLU epilogues and per-row weight scales). CPU only; raises for a plan that cannot run."""
    out = [(v, tma.plan(n, k, **VARIANTS[v])) for n, k in shapes for v in variants]
    res = [v for v in variants if v in RESIDUAL_VARIANTS] or list(variants[:1])
    out += [(v, tma.plan(n, k, residual=True, **VARIANTS[v])) for n, k in shapes for v in res]
    out += [(v, tma.plan(n, k, swiglu=mode, **VARIANTS[v])) for n, k in shapes for v in res
            for mode in tma.SWIGLUS if n % 32 == 0]  # fmt: skip
    out += [(v, tma.plan(n, k, gw_rows=True, residual=r, **VARIANTS[v])) for n, k in shapes
            for v in res for r in (False, True)]  # fmt: skip
    return out + [(v, tma.plan(n, k, gw_rows=True, swiglu="stacked", **VARIANTS[v]))
                  for n, k in shapes for v in res if n % 32 == 0]  # fmt: skip


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 2**31


def _write(path, result) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(result, f, indent=1)


class _Buf:
    """A torch tensor as bench_kernel's read floor takes it (a pointer and an element count)."""

    def __init__(self, t):
        self.t, self.size = t, t.numel()

    def unsafe_buffer_pointer(self) -> int:
        return self.t.data_ptr()


def _values64(torch, lut, p, s):
    """codes [R, K/2] and scale bytes [R, K/16] (uint8 torch, GPU) -> e2m1 * SF float64 [R, K]."""
    pt = p.long()
    codes = torch.stack([pt & 15, pt >> 4], -1).reshape(p.shape[0], -1)
    v = lut[codes].reshape(p.shape[0], -1, 16)
    return (v * s.view(torch.float8_e4m3fn).double()[..., None]).reshape(p.shape[0], -1)


def _operands(torch, n, k, layers, copies, seed, gw_rows=False):
    """Random NVFP4 operands on the GPU: `copies` weight stacks [layers, N, K/2] codes and
    [layers, N, K/16] E4M3 scales, global scales [layers] (`gw_rows`: [layers, N], one a row),
    one token's x codes, scales and global scale (uniform codes, scales 0.125 .. 240, as the GPU
    tests)."""
    dev = DEVICE
    rng = np.random.default_rng(_seed(*seed))
    g = torch.Generator(device=dev).manual_seed(_seed(*seed, "w"))
    wps = [torch.randint(0, 256, (layers, n, k // 2), dtype=torch.uint8, device=dev, generator=g)
           for _ in range(copies)]  # fmt: skip
    wss = [torch.randint(*SCALES, (layers, n, k // 16), dtype=torch.uint8, device=dev, generator=g)
           for _ in range(copies)]  # fmt: skip
    shape = (layers, n) if gw_rows else (layers,)
    wg = torch.from_numpy((rng.random(shape) * 1e-3 + 1e-4).astype(np.float32)).to(dev)
    xp = torch.from_numpy(rng.integers(0, 256, (k // 2,), dtype=np.uint8)).to(dev)
    xs = torch.from_numpy(rng.integers(*SCALES, (k // 16,), dtype=np.uint8)).to(dev)
    xg = torch.tensor([rng.random() * 1e-2 + 1e-3], dtype=torch.float32, device=dev)
    return wps, wss, wg, xp, xs, xg


def check_shape(
    torch,
    bk,
    n,
    k,
    variants,
    time_it: bool,
    sms: int,
    residual=False,
    layers=1,
    layer=0,
    gw_rows=False,
) -> tuple[list, list, list]:
    """Correctness rows, timing rows and failures of every variant at (N, K), planned for `sms`
    SMs (the device's, as production's plan is): with `residual` the residual epilogue (y = res +
    y); the weights stacked `layers` deep and `layer` read; `gw_rows`: one weight global scale a
    row. Production and the variants take the same operands (xp, xs, xg, [res], wp, ws, wg,
    layer) and y."""
    from cuda_ops import nvfp4_gemv

    dev = DEVICE
    tag = f"{n}x{k}" + ("+res" if residual else "") + (f" L{layer}/{layers}" if layers > 1 else "")
    tag += " gw_rows" if gw_rows else ""
    nbytes = n * k // 2 + n * k // 16
    copies = bk._copies(nbytes) if time_it else 1
    seed = (n, k, residual, layers, gw_rows)
    wps, wss, wg, xp, xs, xg = _operands(torch, n, k, layers, copies, seed, gw_rows)
    li = torch.tensor(layer, dtype=torch.int32, device=dev)
    lut = torch.tensor(LUT, dtype=torch.float64, device=dev)
    x64 = _values64(torch, lut, xp[None], xs[None])[0] * float(xg)
    y64 = torch.zeros(n, dtype=torch.float64, device=dev)
    for r0 in range(0, n, 2048):  # float64 weights in row blocks (24576 x 4096 at once: 800 MB)
        rows_ = slice(r0, r0 + 2048)
        w64 = _values64(torch, lut, wps[0][layer, rows_], wss[0][layer, rows_])
        y64[rows_] = w64 @ x64 * (wg[layer, rows_].double() if gw_rows else float(wg[layer]))
    res = None
    if residual:  # a residual of the output's size, in bf16
        res = (torch.randn(n, dtype=torch.float64, device=dev) * y64.std()).to(torch.bfloat16)
        y64 = y64 + res.double()
    floor = float(torch.linalg.norm(y64.to(torch.bfloat16).double() - y64) / torch.linalg.norm(y64))
    stream = torch.cuda.current_stream().cuda_stream
    prod = nvfp4_gemv.build("w4a4", 1, n, k, residual=residual, gw_rows=gw_rows)

    def ptrs(i, y):
        head = [xp.data_ptr(), xs.data_ptr(), xg.data_ptr()]
        head += [res.data_ptr()] if residual else []
        return head + [wps[i].data_ptr(), wss[i].data_ptr(), wg.data_ptr(), li.data_ptr(),
                       y.data_ptr()]  # fmt: skip

    def run(launch):
        y = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=dev)
        launch(stream, ptrs(0, y))
        torch.cuda.synchronize()
        return y

    def rel(a, b):
        return float(torch.linalg.norm(a.double() - b.double()) / torch.linalg.norm(b.double()))

    rows, timing, failures = [], [], []
    y_prod = run(prod.launch)
    prod_err = rel(y_prod, y64)
    # the GPU tests' bound (1.5 x float64 merely rounded to bf16); with the residual two roundings
    # (the product's, then the sum's), so production's own error, with a margin, where larger
    bound = max(1.5 * floor, 1.25 * prod_err if residual else 0.0) + 1e-6
    rows.append({"case": tag, "variant": "production", "plan": str(prod.plan),
                 "rel_err": prod_err, "bound": bound})  # fmt: skip
    for v in variants:
        kern = tma.build(n, k, sms=sms, residual=residual, gw_rows=gw_rows, **VARIANTS[v])
        row = {"case": tag, "variant": v, "grid": kern.plan.grid, "smem": kern.plan.smem,
               "in_flight": kern.plan.in_flight}  # fmt: skip
        try:
            row["driver"] = kern.attributes()
            if v not in TIMED_ONLY:
                y1, y2 = run(kern.launch), run(kern.launch)
                row["written"] = bool(torch.isfinite(y1).all())
                row["repeatable"] = bool((y1.view(torch.int16) == y2.view(torch.int16)).all())
                row["rel_err"] = rel(y1, y64)
                row["bound"] = bound
                row["vs_production_rel"] = rel(y1, y_prod)
                row["vs_production_bitwise"] = float(
                    (y1.view(torch.int16) == y_prod.view(torch.int16)).double().mean()
                )
                ok = row["written"] and row["repeatable"] and row["rel_err"] <= bound
                row["ok"] = ok
                if not ok:
                    failures.append(f"{v} {tag}: {row}")
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            failures.append(f"{v} {tag}: {row['error']}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not time_it:
        return rows, timing, failures

    outs = [torch.empty((n,), dtype=torch.bfloat16, device=dev) for _ in range(copies)]

    def graph_time(launch):
        def mk(i):
            return lambda: launch(torch.cuda.current_stream().cuda_stream, ptrs(i, outs[i]))

        return bk.time_torch_graph(torch, [mk(i) for i in range(copies)])

    t = {"case": tag, "n": n, "k": k, "residual": residual, "bytes": nbytes, "copies": copies}
    t["production_s"] = graph_time(prod.launch)
    for v in variants:
        if any(f.startswith(f"{v} {tag}:") for f in failures):
            continue
        try:
            t[f"{v}_s"] = graph_time(
                tma.build(n, k, sms=sms, residual=residual, gw_rows=gw_rows, **VARIANTS[v]).launch
            )
        except Exception as err:  # noqa: BLE001
            t[f"{v}_error"] = f"{type(err).__name__}: {err}"[:300]
    t["production_again_s"] = graph_time(prod.launch)  # drift check
    w = [(_Buf(a), _Buf(b)) for a, b in zip(wps, wss, strict=True)]
    t["read_floor_4cta_s"] = bk.time_read_floor_graph(torch, w)
    t["read_floor_1cta_s"] = bk.time_read_floor_graph(torch, w, grid_per_sm=1)
    timing.append(t)
    print(json.dumps(t), flush=True)
    return rows, timing, failures


_MODULES: dict = {}


def _launch_ptx(ptx: str, entry: str, grid, threads: int, smem: int, ptrs, stream) -> None:
    """A direct launch of a PTX entry (module loaded once per PTX text)."""
    import ctypes

    from cuda.bindings import driver

    from cuda_ops.nvfp4_gemv import _drv_check

    key = (ptx, entry)
    if key not in _MODULES:
        module = _drv_check(driver.cuModuleLoadData(ptx.encode() + b"\0"), "load")
        fn = _drv_check(driver.cuModuleGetFunction(module, entry.encode()), "function")
        if smem > 48 * 1024:
            attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
            _drv_check(driver.cuFuncSetAttribute(fn, attr, smem), "smem")
        _MODULES[key] = (module, fn)
    fn = _MODULES[key][1]
    gx, gy = grid
    params = (tuple(ptrs), tuple(ctypes.c_void_p for _ in ptrs))
    _drv_check(
        driver.cuLaunchKernel(fn, gx, gy, 1, threads, 1, 1, smem, stream, params, 0), "launch"
    )


def check_swiglu(
    torch, bk, n, k, variants, time_it: bool, sms: int, xgd_values, layer=1, gw_rows=False
):
    """gate_up's SwiGLU epilogue (N = 2F) at `layer` of a stacked weight, down_proj's static
    scale `xgd_values` (stacked [L] when several, else one value): each variant's codes, block
    scales and global scale must be the bytes of its own plain build's y fed to production's
    quantizer kernel (prologue "swiglu": the same device arithmetic), and are compared with
    production's SWIGLU_OUT GEMV (fraction of equal bytes: the fp32 sums differ in order).
    Timed against production's SWIGLU_OUT GEMV."""
    from cuda_ops import nvfp4_gemv, nvfp4_quant

    dev, f = DEVICE, n // 2
    stacked = len(xgd_values) > 1
    mode = "stacked" if stacked else "scalar"
    tag = f"{n}x{k} swiglu {mode} L{layer}" + (" gw_rows" if gw_rows else "")
    layers = max(layer + 1, len(xgd_values))
    nbytes = n * k // 2 + n * k // 16
    copies = bk._copies(nbytes) if time_it else 1
    seed = (n, k, "swiglu", mode, gw_rows)
    wps, wss, wg, xp, xs, xg = _operands(torch, n, k, layers, copies, seed, gw_rows)
    xgd = torch.tensor(list(xgd_values), dtype=torch.float32, device=dev)
    li = torch.tensor(layer, dtype=torch.int32, device=dev)
    nw = torch.zeros(1, dtype=torch.bfloat16, device=dev)
    stream = torch.cuda.current_stream().cuda_stream
    quant = nvfp4_quant.build(1, f, nvfp4_gemv.Fused(prologue="swiglu", scale_stacked=stacked))
    prod = nvfp4_gemv.build("w4a4", 1, n, k, swiglu_out=mode, gw_rows=gw_rows)
    pp = prod.plan

    def outs():
        return (torch.full((f // 2,), 0xAB, dtype=torch.uint8, device=dev),
                torch.full((f // 16,), 0xAB, dtype=torch.uint8, device=dev),
                torch.full((1,), float("nan"), dtype=torch.float32, device=dev))  # fmt: skip

    def ptrs(i, o):
        head = [xp, xs, xg, wps[i], wss[i], wg, li, xgd]
        return [t.data_ptr() for t in (*head, *o)]

    def prod_launch(stream, p):
        _launch_ptx(prod.ptx, prod.entry, (pp.grid, 1), pp.threads, pp.smem, p, stream)

    def run(launch):
        o = outs()
        launch(stream, ptrs(0, o))
        torch.cuda.synchronize()
        return o

    def same(a, b) -> float:
        return float((a.view(torch.uint8) == b.view(torch.uint8)).double().mean())

    rows, timing, failures = [], [], []
    p_out = run(prod_launch)
    for v in variants:
        row = {"case": tag, "variant": v}
        try:
            kern = tma.build(n, k, sms=sms, swiglu=mode, gw_rows=gw_rows, **VARIANTS[v])
            plain = tma.build(n, k, sms=sms, gw_rows=gw_rows, **VARIANTS[v])
            o1, o2 = run(kern.launch), run(kern.launch)
            y = torch.full((n,), float("nan"), dtype=torch.bfloat16, device=dev)
            plain.launch(stream, [t.data_ptr() for t in (xp, xs, xg, wps[0], wss[0], wg, li, y)])
            want = outs()
            _launch_ptx(quant.ptx, nvfp4_quant.ENTRY, (1, f // quant.chunk), quant.threads, 0,
                        [y.data_ptr(), xgd.data_ptr(), nw.data_ptr(), li.data_ptr(),
                         *(t.data_ptr() for t in want)], stream)  # fmt: skip
            torch.cuda.synchronize()
            row["repeatable"] = all(same(a, b) == 1.0 for a, b in zip(o1, o2, strict=True))
            row["equal_to_plain_then_quantizer"] = [
                same(a, b) for a, b in zip(o1, want, strict=True)
            ]
            row["equal_to_production"] = [same(a, b) for a, b in zip(o1, p_out, strict=True)]
            row["ok"] = row["repeatable"] and row["equal_to_plain_then_quantizer"] == [1.0] * 3
            if not row["ok"]:
                failures.append(f"{v} {tag}: {row}")
        except Exception as err:  # noqa: BLE001
            row["error"] = f"{type(err).__name__}: {err}"[:400]
            failures.append(f"{v} {tag}: {row['error']}")
        rows.append(row)
        print(json.dumps(row), flush=True)
    if not time_it:
        return rows, timing, failures
    bufs = [outs() for _ in range(copies)]

    def graph_time(launch):
        def mk(i):
            return lambda: launch(torch.cuda.current_stream().cuda_stream, ptrs(i, bufs[i]))

        return bk.time_torch_graph(torch, [mk(i) for i in range(copies)])

    t = {"case": tag, "n": n, "k": k, "swiglu": True, "bytes": nbytes, "copies": copies}
    t["production_s"] = graph_time(prod_launch)
    for v in variants:
        if not any(f.startswith(f"{v} {tag}:") for f in failures):
            kern = tma.build(n, k, sms=sms, swiglu=mode, gw_rows=gw_rows, **VARIANTS[v])
            t[f"{v}_s"] = graph_time(kern.launch)
    t["production_again_s"] = graph_time(prod_launch)
    w = [(_Buf(a[layer]), _Buf(b[layer])) for a, b in zip(wps, wss, strict=True)]
    t["read_floor_4cta_s"] = bk.time_read_floor_graph(torch, w)
    timing.append(t)
    print(json.dumps(t), flush=True)
    return rows, timing, failures


def summarize(timing: list, variants) -> dict:
    """Per epilogue ("plain", "residual", "swiglu") and variant: time / production's per case and
    the geomean over cases; the geomean against the 4-CTA read floor."""
    out = {}

    def epilogue(t) -> str:
        return "swiglu" if t.get("swiglu") else "residual" if t.get("residual") else "plain"

    for epi in ("plain", "residual", "swiglu"):
        rows = [t for t in timing if epilogue(t) == epi]
        for v in ["production", *variants]:
            key = f"{v}_s"
            r_prod = [t[key] / t["production_s"] for t in rows if key in t]
            r_floor = [t[key] / t["read_floor_4cta_s"] for t in rows if key in t]
            if r_prod:
                out.setdefault(epi, {})[v] = {
                    "cases": [t["case"] for t in rows if key in t],
                    "time_over_production": [round(r, 4) for r in r_prod],
                    "geomean_over_production": float(np.exp(np.mean(np.log(r_prod)))),
                    "geomean_over_read_floor": float(np.exp(np.mean(np.log(r_floor)))),
                    "us": [round(1e6 * t[key], 2) for t in rows if key in t],
                }
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"of {sorted(VARIANTS)}")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument(
        "--git-sha", default=None, help="the commit measured (the device's .git may lag)"
    )
    ap.add_argument(
        "--shapes",
        default=DEFAULT_SHAPES,
        help="N x K pairs, comma-separated (a small one for compute-sanitizer)",
    )
    args = ap.parse_args(argv)
    variants = args.variants.split(",")
    for v in variants:
        if v not in VARIANTS:
            raise SystemExit(f"--variants: {v!r} is not one of {sorted(VARIANTS)}")
    try:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes.split(",")]
        if any(len(s) != 2 for s in shapes):
            raise ValueError
    except ValueError:
        raise SystemExit(f"--shapes {args.shapes!r}: expected N x K pairs like 4096x4096,1024x2048")
    try:
        problems(shapes, variants)  # every plan valid before any GPU work
    except KernelError as err:
        raise SystemExit(f"--shapes / --variants: {err}") from err
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # JAX (versions) beside torch
    import torch

    from cuda_ops import build as cbuild
    from experiments import bench_kernel as bk

    t0 = time.time()
    sms = cbuild.device_sms()
    result = {
        "versions": bk._versions(torch),
        "git_sha": args.git_sha,
        "device": torch.cuda.get_device_name(),
        "sms": sms,
        "nvrtc": ".".join(map(str, cbuild.nvrtc_version())),
        "method": __doc__,
        "variants": {v: VARIANTS[v] for v in variants},
        "ptxas": {},
        "rows": [],
        "timing": [],
    }
    for n, k in shapes:
        p = tma.plan(n, k, sms=sms, **VARIANTS[variants[0]])
        rep = tma.ptxas_report(p)
        result["ptxas"][f"{n}x{k}"] = {k2: v2 for k2, v2 in rep.items() if k2 != "log"}
    if not args.no_time:
        result["copy_bandwidth_Bps"] = bk.copy_bandwidth(torch)
    _write(args.out, {**result, "partial": True})
    failures = []
    # every shape plain, with every variant; the residual epilogue where the decoder has it (o and
    # down: N = hidden) or on every given shape (--shapes), with the first variants of
    # RESIDUAL_VARIANTS; a stacked weight read at its last layer, correctness only
    res_variants = [v for v in variants if v in RESIDUAL_VARIANTS] or variants[:1]
    cases = [(n, k, variants, {}) for n, k in shapes]
    cases += [(n, k, res_variants, {"residual": True}) for n, k in shapes
              if args.shapes != DEFAULT_SHAPES or n == 4096]  # fmt: skip
    n0, k0 = shapes[0]
    stack = {"layers": 3, "layer": 2, "time": False}
    cases += [(min(n0, 1024), k0, res_variants, {"residual": r, **stack}) for r in (False, True)]
    # one global scale a row (fused q/k/v and gate/up shards of a real checkpoint), o's residual
    cases += [(min(n0, 1024), k0, res_variants, {"gw_rows": True, "residual": r, **stack})
              for r in (False, True)]  # fmt: skip
    for n, k, vs, kw in cases:
        time_it = kw.pop("time", True) and not args.no_time
        rows, timing, fails = check_shape(torch, bk, n, k, vs, time_it, sms, **kw)
        result["rows"] += rows
        result["timing"] += timing
        failures += fails
        _write(args.out, {**result, "partial": True})
    # gate_up's SwiGLU epilogue: on gate_up's shape (every given shape of N % 32 == 0 with
    # --shapes), down's scale stacked (timed), and one saturating scalar (correctness)
    for n, k in shapes:
        if n % 32 or (args.shapes == DEFAULT_SHAPES and n != 24576):
            continue
        for xgd, timed, gw_rows in (((0.0047, 0.0031), True, False), ((1e-9,), False, False),
                                    ((0.0047, 0.0031), False, True)):  # fmt: skip
            rows, timing, fails = check_swiglu(
                torch,
                bk,
                n,
                k,
                res_variants,
                timed and not args.no_time,
                sms,
                xgd,
                gw_rows=gw_rows,
            )
            result["rows"] += rows
            result["timing"] += timing
            failures += fails
            _write(args.out, {**result, "partial": True})
    result["summary"] = summarize(result["timing"], variants)
    result["failures"] = failures
    result["wall_s"] = time.time() - t0
    _write(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    print(f"{len(failures)} failures" + "".join(f"\n  {f}" for f in failures))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
