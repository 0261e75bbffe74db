"""bf16 decode GEMMs, fused against split: one [M, D] x [N_q + 2 N_kv, D] dot against three, and
one gate_up [2F, D] dot against two, at decode batch sizes.

Each variant runs `--layers` distinct weights (so no layer is served from L2) inside a jitted
`fori_loop` of `--steps` iterations; the time per layer-step is the median of `--repeats` loops,
all variants in the same process. Dimension letters: rejax/config.py.

    PYTHONPATH=. python3 experiments/bench_fused_gemm.py --out OUT.json      # H200
    PYTHONPATH=. python3 experiments/bench_fused_gemm.py --tiny --out OUT.json  # CPU check
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp

from rejax import bench as rbench
from rejax import config as rconfig


def _time(f, args, repeats):
    jax.block_until_ready(f(*args))
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _chain(steps):
    """jit(x, ws): `steps` x (for each layer: y = sum of dots(x, w parts); x <- f(y))."""

    def body(_, carry):
        x, ws = carry
        for w in ws:  # layers
            outs = [jnp.einsum("md,nd->mn", x, p) for p in w]
            y = sum(o.astype(jnp.float32).sum() for o in outs)  # every output is used
            x = (x + 1e-6 * y).astype(x.dtype)
        return x, ws

    return jax.jit(lambda x, ws: jax.lax.fori_loop(0, steps, body, (x, ws))[0])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8, 16, 64])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    cfg = rconfig.PRESETS[args.preset]
    d, f = cfg.hidden_size, cfg.intermediate_size
    nq, nkv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    if args.tiny:
        d, f, nq, nkv, args.steps, args.repeats = 256, 512, 256, 128, 2, 1
    key = jax.random.key(0)
    variants = {
        "qkv_fused": [(nq + 2 * nkv,)],
        "qkv_split": [(nq,), (nkv,), (nkv,)],
        "gate_up_fused": [(2 * f,)],
        "gate_up_split": [(f,), (f,)],
    }
    rows = []
    for name, parts in variants.items():
        ws = []
        for i in range(args.layers):
            ks = jax.random.split(jax.random.fold_in(key, i), len(parts))
            ws.append(
                tuple(
                    (0.02 * jax.random.normal(k, (n, d), jnp.float32)).astype(jnp.bfloat16)
                    for k, (n,) in zip(ks, parts, strict=True)
                )
            )
        ws = tuple(ws)
        for b in args.batch:
            x = jnp.full((b, d), 0.1, jnp.bfloat16)
            fn = _chain(args.steps)
            t = _time(fn, (x, ws), args.repeats)
            us = 1e6 * t / (args.steps * args.layers)
            rows.append({"variant": name, "batch": b, "us_per_layer": us})
            print(f"[{name} b{b}] {us:.2f} us per layer", flush=True)
        del ws
    ratios = {}
    for b in args.batch:
        by = {r["variant"]: r["us_per_layer"] for r in rows if r["batch"] == b}
        ratios[f"b{b}"] = {
            "qkv_fused_over_split": by["qkv_fused"] / by["qkv_split"],
            "gate_up_fused_over_split": by["gate_up_fused"] / by["gate_up_split"],
        }
    out = {"versions": rbench.versions(), "args": vars(args), "rows": rows, "ratios": ratios}
    with open(args.out, "w") as fh:
        json.dump(out, fh, indent=2)
    print(json.dumps(ratios, indent=1))


if __name__ == "__main__":
    main()
