"""EXPERIMENT (device, [T2-C]): the GEMM variants of nvfp4_gemm_xor.py (repacked codes with a
4-shift decode, compile-time stage copies, both) checked bit for bit against production and
timed, on one GPU. From the repository root:

    PYTHONPATH=. python3 experiments/kernels/check_gemm_xor.py --out $OUT/gemm_xor.json

1. Builds production's GEMM (its plan) and each variant with the same plan (NVRTC in threads)
   for the Qwen3-8B shapes N x K = 6144x4096, 4096x4096, 24576x4096, 4096x12288 at `--ms`
   (default 8, 16, 32, 64), plus `EXTRA` cases: M that pad their token tile (9, 17, 40), N that
   is not a multiple of the weight tile (1000), the residual epilogue and per-row global scales.
2. Runs each kernel on random NVFP4 weights and activations into NaN-poisoned outputs, twice,
   the repacking variants on `repack_codes` of the same codes. The decoded fp16 weights are
   production's bit for bit and the copies move the same bytes, so every output must equal
   production's bit for bit (and be written, and repeat).
3. Times every kernel alone as experiments/bench_gemm.py does (one CUDA graph of direct
   launches over weight copies that read > 256 MiB, CUDA events, median of 25 replays), the
   repacking variants over repacked copies, and the jitted bf16 dot (`--no-bf16` skips it).
4. Writes one JSON (versions, git sha from GIT_SHA, device, plans, registers from the driver,
   rows, timings, per-M geomeans of the speedup over production and over bf16) and exits 1 if
   any output differed.

GEMM letters: M tokens, N out features, K in features.
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

from experiments.kernels import nvfp4_gemm_xor as xor
from experiments.kernels.check_gemm_wgmma import (
    _geo,
    _run,  # a direct launch into NaN-poisoned outputs (and workspace): (y, written)
    _write,
    print_table,
    weight_copies,
)

QWEN3_8B_SHAPES = ((6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288))
DEFAULT_MS = (8, 16, 32, 64)
DEFAULT_VARIANTS = ("xor", "static", "xor_static", "static_nocap")
# (tag, n, k, m, residual, gw_rows): correctness only
EXTRA = (
    ("pad_m9", 4096, 4096, 9, False, False),
    ("pad_m17", 6144, 4096, 17, False, False),
    ("pad_m40", 4096, 12288, 40, False, False),
    ("ragged_n", 1000, 4096, 16, False, False),
    ("ragged_n_m8", 1000, 4096, 8, False, False),
    ("residual", 4096, 4096, 16, True, False),
    ("residual_m64", 4096, 12288, 64, True, False),
    ("gw_rows", 6144, 4096, 32, False, True),
)


def _seed(*parts) -> int:
    return zlib.crc32(repr(parts).encode()) % 2**31


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'N:K,N:K' -> ((N, K), ...); SystemExit naming the bad item."""
    out = []
    for item in text.split(","):
        try:
            n, k = (int(v) for v in item.split(":"))
        except ValueError:
            raise SystemExit(f"--shapes item {item!r}: expected N:K, e.g. 4096:4096") from None
        if n < 1 or k < 128 or k % 128:
            raise SystemExit(f"--shapes item {item!r}: N >= 1 and K a multiple of 128 expected")
        out.append((n, k))
    return tuple(out)


def parse_variants(text: str) -> tuple[str, ...]:
    names = tuple(v for v in text.split(",") if v)
    for v in names:
        if v not in xor.VARIANTS or v == "production":
            others = sorted(set(xor.VARIANTS) - {"production"})
            raise SystemExit(f"--variants: {v!r} is not one of {others}")
    if not names:
        raise SystemExit("--variants: name at least one variant")
    return names


def cases(shapes, ms, with_extra=True) -> list[tuple]:
    """(tag, n, k, m, residual, gw_rows) of the correctness phase. CPU only."""
    out = [("model", n, k, m, False, False) for n, k in shapes for m in ms]
    return out + (list(EXTRA) if with_extra else [])


def build_all(case_list, variants, num_sms=None):
    """{(case, variant): GemmKernel} with production under "production" (NVRTC in threads)."""
    from cuda_ops import build as cbuild
    from cuda_ops import nvfp4_gemm

    num_sms = num_sms or cbuild.device_sms()
    probs, keys = [], []
    for case in case_list:
        _, n, k, m, residual, gw_rows = case
        for v in ("production", *variants):
            opts = xor.options(v, m, n, k, num_sms)
            probs.append({"m": m, "n": n, "k": k, "options": opts, "residual": residual,
                          "gw_rows": gw_rows})  # fmt: skip
            keys.append((case, v))
    return dict(zip(keys, nvfp4_gemm.prebuild(probs), strict=True))


class _Ctx:
    def __init__(self):
        import jax
        import jax.numpy as jnp
        import torch

        from experiments import bench_gemm
        from experiments import bench_kernel as bk
        from rejax import nvfp4
        from rejax.ops import linear

        self.jax, self.jnp, self.torch = jax, jnp, torch
        self.bench_gemm, self.bk, self.nvfp4 = bench_gemm, bk, nvfp4
        self.x_op = jax.jit(linear.gemm_x_operand)
        self.layer0 = jnp.zeros((), jnp.int32)


def _registers(kernel) -> dict:
    """What the driver's JIT made of the main entry: registers per thread, local bytes."""
    try:
        from cuda.bindings import driver

        from cuda_ops import nvfp4_gemm

        fn = nvfp4_gemm._function(kernel, nvfp4_gemm.ENTRY)
        attr = driver.CUfunction_attribute
        regs = driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_NUM_REGS, fn)[1]
        local = driver.cuFuncGetAttribute(attr.CU_FUNC_ATTRIBUTE_LOCAL_SIZE_BYTES, fn)[1]
        return {"registers": int(regs), "local_bytes": int(local)}
    except Exception as err:  # noqa: BLE001
        return {"error": f"{type(err).__name__}: {err}"[:200]}


def judge(torch, y_prod, y1, y2, written: bool) -> tuple[dict, str | None]:
    """A variant's two runs (bf16 torch [M, N]) against production's output: its record and
    why it failed (None: written, bitwise repeatable and bitwise production's)."""
    eq = (y1.view(torch.int16) == y_prod.view(torch.int16)).double().mean().item()
    r = {
        "written": written,
        "repeatable": bool(torch.equal(y1.view(torch.int16), y2.view(torch.int16))),
        "frac_bitwise_equal_production": eq,
    }
    why = None
    if not written:
        why = "unwritten or non-finite outputs"
    elif not r["repeatable"]:
        why = "not bitwise repeatable"
    elif eq != 1.0:
        why = f"only {eq:.6f} of the outputs equal production's bits"
    r["passed"] = why is None
    return r, why


def check_case(c: _Ctx, case, kernels: dict, variants) -> tuple[dict, list]:
    """Production and every variant on one case: bitwise equality, written, repeatable."""
    jnp, torch = c.jnp, c.torch
    tag, n, k, m, residual, gw_rows = case
    rng = np.random.default_rng(_seed(case))
    wp = rng.integers(0, 256, (n, k // 2), dtype=np.uint8)
    ws = rng.integers(0x20, 0x78, (n, k // 16), dtype=np.uint8)
    gw = (rng.random(n if gw_rows else ()) * 1e-3 + 1e-4).astype(np.float32)
    xp = rng.integers(0, 256, (m, k // 2), dtype=np.uint8)
    xs = rng.integers(0x20, 0x78, (m, k // 16), dtype=np.uint8)
    xg = (rng.random(m) * 1e-2 + 1e-3).astype(np.float32)
    res = (rng.standard_normal((m, n)) * 0.1).astype(np.float32)
    xh = c.jax.block_until_ready(c.x_op(jnp.asarray(xp), jnp.asarray(xs)))
    d = {
        "xg": jnp.asarray(xg),
        "res": jnp.asarray(res, jnp.bfloat16),
        "wp": jnp.asarray(wp),
        "wp_repacked": jnp.asarray(xor.repack_codes(wp)),
        "ws": jnp.asarray(ws),
        "gw": jnp.asarray(gw),
    }
    # raw pointers go to launches on torch's stream, which does not wait for JAX's transfers
    c.jax.block_until_ready((d, c.layer0))

    def ptrs(repacked: bool):
        out = [xh.unsafe_buffer_pointer(), d["xg"].unsafe_buffer_pointer()]
        if residual:
            out.append(d["res"].unsafe_buffer_pointer())
        codes = d["wp_repacked" if repacked else "wp"]
        return out + [
            codes.unsafe_buffer_pointer(),
            d["ws"].unsafe_buffer_pointer(),
            d["gw"].unsafe_buffer_pointer(),
            c.layer0.unsafe_buffer_pointer(),
        ]

    row = {"tag": tag, "n": n, "k": k, "m": m, "residual": residual, "gw_rows": gw_rows}
    failures = []
    y_prod, ok = _run(c, kernels[(case, "production")], ptrs(False), m, n)
    p = kernels[(case, "production")].plan
    row["plan"] = {f: getattr(p, f) for f in ("tm", "wr", "kt", "stages", "splitk")}
    row["production_written"] = ok
    if not ok:
        failures.append((tag, n, k, m, "production", "unwritten or non-finite outputs"))
    for v in variants:
        kern = kernels[(case, v)]
        y1, ok1 = _run(c, kern, ptrs(xor.REPACKED[v]), m, n)
        y2, _ = _run(c, kern, ptrs(xor.REPACKED[v]), m, n)
        r, why = judge(torch, y_prod, y1, y2, ok1)
        if why:
            failures.append((tag, n, k, m, v, why))
        row[v] = r
    return row, failures


def time_shape(c: _Ctx, n, k, ms, kernels, variants, with_bf16: bool, names=None) -> list:
    """Kernel-alone times (CUDA graph over weight copies) at every M, as bench_gemm.py, of
    production and `variants` (or only `names`, e.g. one kernel under a profiler)."""
    names = tuple(names) if names else ("production", *variants)
    jax, jnp, torch, bk = c.jax, c.jnp, c.torch, c.bk
    nv_bytes = n * k // 2 + n * k // 16
    copies = bk._copies(nv_bytes)
    weights, wbf, kx = weight_copies(jax, n, k, copies, with_bf16)
    repack = jax.jit(xor.repack_codes_jax)
    repacked = (
        [(jax.block_until_ready(repack(wp)), ws) for wp, ws in weights]
        if any(xor.REPACKED[v] for v in names)
        else None
    )
    wg = jnp.float32(1e-3)
    rows = []
    for m in ms:
        x = jax.random.normal(jax.random.fold_in(kx, m), (m, k), jnp.bfloat16)
        xq = c.nvfp4.quantize_activation(x)
        xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
        xg = jnp.asarray(xq.global_scale, jnp.float32)
        xh = jax.block_until_ready(c.x_op(xq.packed, xs))
        row = {"n": n, "k": k, "m": m, "nvfp4_bytes": nv_bytes, "copies": copies}
        case = ("model", n, k, m, False, False)
        for v in names:
            ws_ = repacked if xor.REPACKED[v] else weights
            try:
                row[f"{v}_us"] = 1e6 * c.bench_gemm.time_gemm_graph(
                    torch, kernels[(case, v)], xh, xg, ws_, wg, c.layer0
                )
            except Exception as err:  # noqa: BLE001
                row[f"{v}_error"] = f"{type(err).__name__}: {err}"[:300]
        if wbf is not None:
            f = jax.jit(lambda ws, x=x: [jnp.dot(x, w.T) for w in ws])
            row["bf16_us"] = 1e6 * bk.time_jax(f, (wbf,), len(wbf), calls=5, trials=5)
        for v in names:
            if f"{v}_us" in row and "bf16_us" in row:
                row[f"{v}_x_bf16"] = row["bf16_us"] / row[f"{v}_us"]
            if v != "production" and f"{v}_us" in row and "production_us" in row:
                row[f"{v}_speedup_vs_production"] = row["production_us"] / row[f"{v}_us"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    del weights, repacked, wbf
    return rows


def summarize(timing: list, variants) -> dict:
    out = {}
    for m in sorted({r["m"] for r in timing}):
        rs = [r for r in timing if r["m"] == m]
        for v in ("production", *variants):
            xb = [r[f"{v}_x_bf16"] for r in rs if f"{v}_x_bf16" in r]
            if xb:
                out[f"m{m}_{v}_geomean_x_bf16"] = _geo(xb)
            sp = [r[f"{v}_speedup_vs_production"] for r in rs if f"{v}_speedup_vs_production" in r]
            if sp:
                out[f"m{m}_{v}_geomean_speedup_vs_production"] = _geo(sp)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--shapes", default=",".join(f"{n}:{k}" for n, k in QWEN3_8B_SHAPES))
    ap.add_argument("--ms", default=",".join(map(str, DEFAULT_MS)))
    ap.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    ap.add_argument("--no-check", action="store_true", help="timings only (e.g. under ncu)")
    ap.add_argument("--no-extra", action="store_true", help="skip the EXTRA correctness cases")
    ap.add_argument("--no-time", action="store_true", help="correctness only")
    ap.add_argument("--no-bf16", action="store_true", help="skip the jitted bf16 baseline")
    ap.add_argument("--time-only", default=None,
                    help="time only this kernel (production or a variant), e.g. under ncu")  # fmt: skip
    ap.add_argument("--time-budget", type=float, default=240.0,
                    help="seconds from the start after which the remaining shapes are not timed")  # fmt: skip
    args = ap.parse_args(argv)
    shapes = parse_shapes(args.shapes)
    try:
        ms = tuple(int(v) for v in args.ms.split(","))
    except ValueError:
        raise SystemExit(f"--ms {args.ms!r}: expected comma-separated ints, e.g. 8,16") from None
    if any(not 1 <= m <= 64 for m in ms):
        raise SystemExit(f"--ms {args.ms!r}: the variants are for 1 <= M <= 64")
    variants = parse_variants(args.variants)
    if args.time_only is not None and args.time_only not in ("production", *variants):
        raise SystemExit(
            f"--time-only {args.time_only!r}: expected production or one of {variants}"
        )
    t0 = time.time()
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # torch shares the GPU
    c = _Ctx()
    from cuda_ops import build as cbuild

    case_list = cases(shapes, ms, with_extra=not args.no_extra)
    kernels = build_all(case_list, variants)
    build_s = time.time() - t0
    print(f"built {len(kernels)} kernels in {build_s:.1f} s", flush=True)
    result = {
        "git_sha": os.environ.get("GIT_SHA"),
        "versions": c.bk._versions(c.torch),
        "device": str(c.jax.devices()[0]),
        "num_sms": cbuild.device_sms(),
        "method": __doc__,
        "variants": {v: list(xor.VARIANTS[v]) for v in variants},
        "combos": [list(cb) for cb in xor.COMBOS],
        "build_s": build_s,
        "registers": [],
        "rows": [],
        "timing": [],
    }
    for (case, v), kern in kernels.items():
        if case[0] == "model":
            result["registers"].append({"case": list(case), "variant": v, **_registers(kern)})
    _write(args.out, {**result, "partial": True})
    failures, skipped = [], []
    try:
        if not args.no_check:
            for case in case_list:
                row, fails = check_case(c, case, kernels, variants)
                result["rows"].append(row)
                failures.extend(fails)
                brief = {v: row[v]["frac_bitwise_equal_production"] for v in variants}
                print(json.dumps({"case": list(case), "equal": brief}), flush=True)
            _write(args.out, {**result, "partial": True})
        if not args.no_time:
            for n, k in sorted(shapes, key=lambda s: -s[0] * s[1]):
                if time.time() - t0 > args.time_budget:
                    skipped.append([n, k])
                    continue
                only = [args.time_only] if args.time_only else None
                result["timing"] += time_shape(
                    c, n, k, ms, kernels, variants, not args.no_bf16, only
                )
                _write(args.out, {**result, "partial": True})
    except Exception:  # noqa: BLE001 (a kernel fault poisons the context: record, then fail)
        import traceback

        result["exception"] = traceback.format_exc()[-4000:]
        failures.append(("exception", traceback.format_exc().splitlines()[-1]))
    result["skipped_for_time"] = skipped
    result["summary"] = summarize(result["timing"], variants)
    result["failures"] = [list(f) for f in failures]
    result["passed"] = not failures
    result["wall_s"] = time.time() - t0
    _write(args.out, result)
    print(json.dumps(result["summary"], indent=1))
    print_table(result["timing"], ("production", *variants))
    if failures:
        print("FAILED:", *failures, sep="\n  ", file=sys.stderr)
        return 1
    print(f"passed, {result['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
