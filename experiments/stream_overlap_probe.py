"""Can the dot path's weight dequantizer run beside a cuBLAS dot? ([T2-C] batch-8 prefill;
experiments only.)

On the dot path (prefill above the wgmma range) each W4A4 linear dequantizes its weight to
bf16 (`cuda_ops/nvfp4_dequant.cu`, memory-bound, about 172 us a layer of Qwen3-8B on an H100)
and then runs one bf16 dot (compute-bound, about 2.3 ms a layer at 4096 rows). The dequantizer
depends on the weights and the layer index only, so the next linear's could run while the
current dot does, if XLA put it on another stream: JAX's `compute_on("gpu_stream:1")` marks a
jitted call with `_xla_stream_annotation`, which XLA wraps in an async start / done pair. This
probe times, in one process, at Qwen3-8B's gate_up dot (M x 4096 by 24576 x 4096) and the down
weight's dequantizer (4096 x 12288):

  dot          the dot alone;
  dequant      the dequantizer alone;
  serial       both, one after the other (today's order on one stream);
  stream1      both, the dequantizer under compute_on("gpu_stream:1").

Each variant is one jitted function over --inner pairs (independent inputs per pair, so nothing
is hoisted), timed with the host clock around `block_until_ready` (median of --reps after a
warm-up). The JSON holds the medians a pair, the overlap (serial - stream1) / dequant, the
optimized HLO's async starts and stream annotations, and the stream1 results' bits against
serial's.

    PYTHONPATH=. python3 experiments/stream_overlap_probe.py --out experiments/results/stream_overlap.json
    PYTHONPATH=. python3 experiments/stream_overlap_probe.py --dry-run   # lower only (no GPU)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import jax
import jax.numpy as jnp
import numpy as np

from rejax.ops import _dispatch

VARIANTS = ("dot", "dequant", "serial", "stream1")
DOT = (24576, 4096)  # gate_up's [N, K]
DEQUANT = (4096, 12288)  # down's [N, K]


def _dequant_fn(n: int, k: int):
    """(codes, scales, layer) -> bf16 [n, k]: the production dequantizer kernel's call."""
    from cuda_ops import nvfp4_dequant
    from rejax.ops.linear import dequant_call

    kernel = nvfp4_dequant.build(n, k)
    return lambda wp, ws, layer: dequant_call(wp, ws, layer, kernel=kernel)


def build(variant: str, inner: int, deq=None):
    """The jitted function of `variant` over `inner` pairs: (xs [inner, M, K] bf16, w [N, K]
    bf16, codes [inner, N', K'/2], scales [inner, N', K'/16]) -> (dots, values)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANTS}")

    def dot(x, w):
        return jnp.dot(x, w.T, preferred_element_type=jnp.float32)

    def f(xs, w, wps, wss):
        dots, vals = [], []
        for i in range(inner):
            if variant != "dequant":
                dots.append(dot(xs[i], w))
            if variant in ("dequant", "serial"):
                vals.append(deq(wps[i], wss[i], jnp.int32(0)))
            elif variant == "stream1":
                vals.append(_dispatch.on_gpu_stream(deq)(wps[i], wss[i], jnp.int32(0)))
        return dots, vals

    return jax.jit(f)


def _inputs(m: int, inner: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    n, k = DOT
    dn, dk = DEQUANT
    xs = jnp.asarray(rng.standard_normal((inner, m, k)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((n, k)), jnp.bfloat16)
    wps = jnp.asarray(rng.integers(0, 256, (inner, dn, dk // 2), dtype=np.uint8))
    wss = jnp.asarray(rng.integers(0x30, 0x40, (inner, dn, dk // 16), dtype=np.uint8))
    return xs, w, wps, wss


def _time(fn, args, reps: int) -> float:
    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e6


def _git_sha() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "HEAD"], check=False, capture_output=True, text=True
        )
        return out.stdout.strip() or "unknown"
    except OSError:
        return "unknown"


def dry_run(m: int = 64, inner: int = 2) -> dict:
    """Lowers "stream1" for CUDA with a stand-in dequantizer (no GPU, no NVRTC): the StableHLO
    marks the dequantizer's call with the stream annotation and nothing else."""

    def deq(wp, ws, layer):
        del ws, layer
        return (wp.astype(jnp.float32) * 2.0).astype(jnp.bfloat16)

    fn = build("stream1", inner, deq)
    args = _inputs(m, inner)
    text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    calls = [ln for ln in text.splitlines() if "call @" in ln and "custom_call" not in ln]
    marked = [line for line in calls if '_xla_stream_annotation = "1"' in line]
    return {"calls": len(calls), "marked": len(marked)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--m", type=int, default=4096, help="rows of the dot (default 4096)")
    ap.add_argument("--inner", type=int, default=8, help="dot / dequantizer pairs a call")
    ap.add_argument("--reps", type=int, default=20, help="timed calls a variant (median)")
    ap.add_argument("--out", default=None, help="JSON path")
    ap.add_argument("--git-sha", default=None, help="the tree's commit (default: git's HEAD)")
    ap.add_argument("--dry-run", action="store_true", help="lower for CUDA only (no GPU)")
    args = ap.parse_args(argv)
    if args.m < 1 or args.inner < 1 or args.reps < 1:
        ap.error(f"--m, --inner, --reps must be >= 1, got {args.m}, {args.inner}, {args.reps}")
    if args.dry_run:
        print(json.dumps(dry_run()))
        return 0
    if jax.default_backend() != "gpu":
        ap.error("needs a CUDA GPU (use --dry-run to check the lowering)")
    deq = _dequant_fn(*DEQUANT)
    inputs = _inputs(args.m, args.inner)
    fns = {v: build(v, args.inner, deq) for v in VARIANTS}
    hlo = fns["stream1"].lower(*inputs).compile().as_text()
    serial = jax.block_until_ready(fns["serial"](*inputs))
    streamed = jax.block_until_ready(fns["stream1"](*inputs))
    same = all(
        np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
        for a, b in zip(jax.tree.leaves(serial), jax.tree.leaves(streamed), strict=True)
    )
    us = {v: _time(fns[v], inputs, args.reps) for v in VARIANTS}
    per = {v: t / args.inner for v, t in us.items()}
    result = {
        "git_sha": args.git_sha or _git_sha(),
        "jax": jax.__version__,
        "device": str(jax.devices()[0].device_kind),
        "m": args.m,
        "inner": args.inner,
        "reps": args.reps,
        "us_per_pair": per,
        "overlap": (per["serial"] - per["stream1"]) / per["dequant"],
        "async_starts_in_hlo": hlo.count("async-start"),
        "stream_annotations_in_hlo": hlo.count("_xla_stream_annotation"),
        "stream1_bits_equal_serial": bool(same),
    }
    print(json.dumps(result, indent=1))
    if args.out:
        pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
