"""Device checks of the NVFP4 GEMV (run on the H200; writes JSON).

For every layer shape of the five paper models, M = 1..8 and both activation modes, on fresh
random operands: the kernel is launched directly (cuda-python) into a NaN-poisoned output twice,
and checked for (a) every element written and finite, (b) bitwise repeatability, (c) relative
error against a float64 reference of the same dequantized operands, next to the error of that
reference simply rounded to bf16 (the floor the bf16 output allows). A subset is also compared
with rejax's JAX reference and run through both XLA launch paths and inside `lax.scan`.

`--sanitize` runs a few small shapes with cuda-python only (no torch / JAX), for
compute-sanitizer memcheck and racecheck.

GEMM letters: M tokens, N out features, K in features.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from cuda_ops import nvfp4_gemv
from cuda_ops.build import compile_ptx, read_source
from experiments.kernel_shapes import unique_shapes

ACTS = ("w4a4", "w4a16")
ODD = [(8, 256), (1000, 768), (1003, 1280), (24, 3328), (520, 4352), (1, 512)]


def _prebuild(job):
    act, m, n, k = job
    p = nvfp4_gemv.plan(act, m, n, k)
    compile_ptx(
        read_source(nvfp4_gemv.SOURCE),
        name=nvfp4_gemv.SOURCE,
        defines=p.defines(),
        arch="compute_90",
    )
    return job


def prebuild(jobs, workers=16):
    t = time.time()
    with ProcessPoolExecutor(workers) as ex:
        list(ex.map(_prebuild, jobs, chunksize=4))
    return time.time() - t


# ----------------------------------------------------------------------------- torch side


def _torch_ops():
    import torch

    lut = torch.tensor(
        [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
        dtype=torch.float64,
        device="cuda",
    )

    def values(packed):  # uint8 [R, K/2] -> f64 [R, K]
        codes = torch.stack([packed & 15, packed >> 4], dim=-1).reshape(packed.shape[0], -1)
        return lut[codes.long()]

    def e4m3(s):  # uint8 -> f64
        return s.view(torch.float8_e4m3fn).to(torch.float64)

    def dequant(packed, scales):  # f64 [R, K], block scales applied
        v = values(packed)
        return (v.reshape(v.shape[0], -1, 16) * e4m3(scales)[..., None]).reshape(v.shape)

    return torch, dequant


def random_operands(torch, act, m, n, k, gen):
    """Fresh random operands on the GPU: uniform codes, E4M3 scales in [2^-3, 240]."""

    def codes(rows, cols):
        return torch.randint(0, 256, (rows, cols), dtype=torch.uint8, device="cuda", generator=gen)

    def scales(rows, cols):  # E4M3 bytes 0x20..0x77 (0.125 .. 240)
        return torch.randint(
            0x20, 0x78, (rows, cols), dtype=torch.uint8, device="cuda", generator=gen
        )

    wp, ws = codes(n, k // 2), scales(n, k // 16)
    wg = (torch.rand((), device="cuda", generator=gen) * 1e-3 + 1e-4).float()
    layer = torch.zeros((), dtype=torch.int32, device="cuda")
    if act == "w4a4":
        xp, xs = codes(m, k // 2), scales(m, k // 16)
        xg = (torch.rand((m,), device="cuda", generator=gen) * 1e-2 + 1e-3).float()
        return [xp, xs, xg, wp, ws, wg, layer]
    x = torch.randn((m, k), device="cuda", generator=gen).to(torch.bfloat16)
    return [x, wp, ws, wg, layer]


def reference64(torch, dequant, act, ops):
    if act == "w4a4":
        xp, xs, xg, wp, ws, wg, _ = ops
        x = dequant(xp, xs) * xg.double()[:, None]
    else:
        x, wp, ws, wg, _ = ops
        x = x.double()
    w = dequant(wp, ws) * wg.double()
    return x @ w.T  # [M, N] f64


def launch_poisoned(torch, kernel, ops, m, n):
    out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.current_stream().cuda_stream
    kernel.launch(stream, [t.data_ptr() for t in ops] + [out.data_ptr()])
    torch.cuda.synchronize()
    return out


def rel(torch, a, b):
    return float(torch.linalg.norm(a.double() - b) / torch.linalg.norm(b))


def check_case(torch, dequant, act, m, n, k, gen):
    kernel = nvfp4_gemv.build(act, m, n, k, arch="compute_90")
    ops = random_operands(torch, act, m, n, k, gen)
    y1 = launch_poisoned(torch, kernel, ops, m, n)
    y2 = launch_poisoned(torch, kernel, ops, m, n)
    y64 = reference64(torch, dequant, act, ops)
    floor = rel(torch, y64.to(torch.bfloat16), y64)
    err = rel(torch, y1, y64)
    return (
        {
            "act": act,
            "m": m,
            "n": n,
            "k": k,
            "all_written": bool(torch.isfinite(y1).all()),
            "repeatable": bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16))),
            "rel_err_f64": err,
            "rel_err_bf16_floor": floor,
            "ok": bool(torch.isfinite(y1).all()) and err <= 1.5 * floor + 1e-6,
        },
        ops,
        y1,
    )


# ----------------------------------------------------------------------------- JAX side


def jax_checks(torch, cases, out):
    """Kernel vs rejax's JAX reference (same operands), both XLA launch paths, lax.scan."""
    import jax
    import jax.numpy as jnp

    from rejax.ops import linear as kernels

    res = []
    for (act, m, n, k), ops, y_direct in cases:
        args = [jax.dlpack.from_dlpack(t) for t in ops]
        kw = {"act": act, "n": n, "k": k}
        ref = jax.jit(lambda *a, kw=kw: kernels._reference(*a, **kw))(*args)
        paths = {}
        for launch in ("ptx", "callback"):
            f = jax.jit(
                lambda *a, launch=launch, kw=kw: kernels.gemv_call(
                    a, impl="cuda", launch=launch, **kw
                )
            )
            try:
                paths[launch] = np.asarray(f(*args).astype(jnp.float32))
            except Exception as err:  # noqa: BLE001
                paths[launch] = f"{type(err).__name__}: {err}"[:400]
        direct = y_direct.float().cpu().numpy()
        refn = np.asarray(ref.astype(jnp.float32))
        ulp = np.abs(direct.view(np.int32) - refn.view(np.int32)) >> 16  # bf16 in f32 top bits
        row = {
            "act": act,
            "m": m,
            "n": n,
            "k": k,
            "max_bf16_ulp_vs_jax_ref": int(ulp.max()),
            "frac_differing_vs_jax_ref": float((ulp > 0).mean()),
        }
        for launch, v in paths.items():
            row[f"{launch}_equals_direct"] = (
                bool(np.array_equal(v, direct)) if isinstance(v, np.ndarray) else v
            )
        res.append(row)
        print(row, flush=True)
    # lax.scan vs eager through nvfp4_linear (W4A4 dynamic and W4A16)
    from rejax import nvfp4

    rng = np.random.default_rng(1)
    w = nvfp4.quantize_weight(rng.standard_normal((1024, 2048)).astype(np.float32))
    xs = jnp.asarray(rng.standard_normal((3, 4, 2048)), jnp.bfloat16)
    for act in ACTS:
        eager = [kernels.nvfp4_linear(xs[i], w, act=act, impl="cuda") for i in range(3)]

        def body(c, x, act=act):
            return c, kernels.nvfp4_linear(x, w, act=act, impl="cuda")

        _, scanned = jax.jit(lambda xs, body=body: jax.lax.scan(body, 0, xs))(xs)
        same = all(
            np.array_equal(np.asarray(scanned[i], np.float32), np.asarray(eager[i], np.float32))
            for i in range(3)
        )
        res.append({"check": "scan_vs_eager", "act": act, "equal": same})
        print(res[-1], flush=True)
    out["jax_checks"] = res


# ----------------------------------------------------------------------------- sanitizer


# default plans (nvfp4_gemv.plan): persistent with register prefetch (M = 3, 5), the cp.async ring
# (M = 8), the streaming variant (M <= 2 on small layers)
SANITIZE_CASES = [
    ("w4a4", 3, 520, 4352),
    ("w4a4", 8, 264, 1024),
    ("w4a16", 5, 104, 768),
    ("w4a16", 8, 72, 512),
    ("w4a4", 1, 4096, 3584),
    ("w4a16", 2, 1000, 768),
]
PROFILE_CASES = [("w4a4", 1, 4096, 12288), ("w4a4", 8, 4096, 12288)]


def raw_runs(cases, repeats=1):
    """Launches through cuda-python only (for compute-sanitizer and ncu)."""
    from cuda.bindings import driver as d

    def ck(r):
        assert int(r[0]) == 0, r
        return r[1] if len(r) > 1 else None

    ck(d.cuInit(0))
    dev = ck(d.cuDeviceGet(0))
    ctx = ck(d.cuDevicePrimaryCtxRetain(dev))
    ck(d.cuCtxSetCurrent(ctx))
    rng = np.random.default_rng(0)
    for act, m, n, k in cases:
        kern = nvfp4_gemv.build(act, m, n, k, arch="compute_90", num_sms=132)
        if act == "w4a4":
            host = [
                rng.integers(0, 256, (m, k // 2), dtype=np.uint8),
                rng.integers(0x20, 0x78, (m, k // 16), dtype=np.uint8),
                np.full((m,), 1e-2, np.float32),
                rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                rng.integers(0x20, 0x78, (n, k // 16), dtype=np.uint8),
                np.full((), 1e-3, np.float32),
                np.zeros((), np.int32),
            ]
        else:
            host = [
                rng.integers(0, 1 << 15, (m, k), dtype=np.uint16),
                rng.integers(0, 256, (n, k // 2), dtype=np.uint8),
                rng.integers(0x20, 0x78, (n, k // 16), dtype=np.uint8),
                np.full((), 1e-3, np.float32),
                np.zeros((), np.int32),
            ]
        ptrs = []
        for a in host:
            p = ck(d.cuMemAlloc(max(a.nbytes, 4)))
            ck(d.cuMemcpyHtoD(p, a.ctypes.data, a.nbytes))
            ptrs.append(int(p))
        out = ck(d.cuMemAlloc(m * n * 2))
        ck(d.cuMemsetD16(out, 0xFFFF, m * n))
        for _ in range(repeats):
            kern.launch(0, ptrs + [int(out)])
        ck(d.cuCtxSynchronize())
        y = np.empty((m, n), np.uint16)
        ck(d.cuMemcpyDtoH(y.ctypes.data, out, y.nbytes))
        written = not np.any(y == 0xFFFF)
        print(f"raw run {act} M={m} N={n} K={k}: all written={written}", flush=True)
        for p in ptrs + [int(out)]:
            ck(d.cuMemFree(p))


# ----------------------------------------------------------------------------- main


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default="experiments/results/gpu_kernel_check.json")
    ap.add_argument("--sanitize", action="store_true")
    ap.add_argument("--profile", action="store_true", help="launches for ncu")
    ap.add_argument("--no-jax", action="store_true", help="skip the JAX / XLA checks")
    ap.add_argument("--ms", default="1,2,3,4,5,6,7,8")
    ap.add_argument("--quick", action="store_true", help="M in {1, 3, 8} only")
    args = ap.parse_args()
    if args.sanitize or args.profile:
        raw_runs(SANITIZE_CASES if args.sanitize else PROFILE_CASES, 1 if args.sanitize else 3)
        return
    all_ms = [int(v) for v in args.ms.split(",")]
    ms = [1, 3, 8] if args.quick else all_ms
    shapes = unique_shapes() + ODD
    jobs = [(act, m, n, k) for act in ACTS for m in ms for n, k in shapes]
    # fill the PTX disk cache for every M (the GPU pytest reuses it)
    build_jobs = [(act, m, n, k) for act in ACTS for m in all_ms for n, k in shapes]
    out = {"prebuild_s": prebuild(build_jobs), "cases": []}
    print(f"prebuilt {len(build_jobs)} kernels in {out['prebuild_s']:.1f} s", flush=True)

    torch, dequant = _torch_ops()
    out["device"] = torch.cuda.get_device_name()
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    jax_cases = []
    t0 = time.time()
    for act, m, n, k in jobs:
        try:
            row, ops, y = check_case(torch, dequant, act, m, n, k, gen)
        except Exception as err:  # noqa: BLE001
            row = {
                "act": act,
                "m": m,
                "n": n,
                "k": k,
                "ok": False,
                "error": f"{type(err).__name__}: {err}"[:600],
            }
            print(row, flush=True)
            out["cases"].append(row)
            continue
        out["cases"].append(row)
        if not row["ok"] or not row["repeatable"]:
            print("FAIL", row, flush=True)
        if (n, k) in [(4096, 12288), (1003, 1280), (5120, 25600)] and m in (1, 3, 8):
            jax_cases.append(((act, m, n, k), ops, y))
        else:
            del ops, y
    out["sweep_s"] = time.time() - t0
    cases = out["cases"]
    out["summary"] = {
        "n_cases": len(cases),
        "n_ok": sum(bool(c.get("ok")) for c in cases),
        "all_written": all(c.get("all_written", False) for c in cases),
        "all_repeatable": all(c.get("repeatable", False) for c in cases),
        "max_rel_err_f64": max((c.get("rel_err_f64", 1.0) for c in cases), default=None),
        "max_err_over_floor": max(
            (c["rel_err_f64"] / c["rel_err_bf16_floor"] for c in cases if "rel_err_f64" in c),
            default=None,
        ),
    }
    print(json.dumps(out["summary"]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
    if args.no_jax:
        return
    try:
        jax_checks(torch, jax_cases, out)
    except Exception as err:  # noqa: BLE001
        out["jax_checks_error"] = f"{type(err).__name__}: {err}"[:2000]
        print(out["jax_checks_error"], flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
