"""ReSET's extra cost per decode step over plain temperature + top-p, and top-p variants.

Each timed function is one jitted `lax.scan` of K consecutive `sample` calls over fresh
[B, V] logits (a per-step shift of one random array) with per-step keys from
`jax.random.fold_in`, so dispatch is amortised; the figure is (median wall time) / K.
Compilation and one warm-up run are excluded; every run ends with `block_until_ready()`.

Usage: PYTHONPATH=. python3 experiments/bench_sampler.py --out experiments/results/bench_sampler_gpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rejax import sampling
from rejax.sampling import ReSET, Temperature, sample, sampler_init, top_p_mask


def _git_sha() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout.strip()  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _median_time(fn, args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile
    jax.block_until_ready(fn(*args))  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def _scan_sampler(sampler, steps: int, method: str, with_info: bool):
    def run(key, logits, state):
        def body(carry, i):
            state, acc = carry
            # a fresh logits slice every step, without a [K, B, V] buffer
            z = logits + (i.astype(jnp.float32) * 1e-3)
            tokens, state, info = sample(jax.random.fold_in(key, i), z, state, sampler,
                                         top_p_method=method)  # fmt: skip
            acc = acc + tokens
            if with_info:
                acc = acc + (info["entropy"] > 0).astype(jnp.int32)
            return (state, acc), None

        acc0 = jnp.zeros((logits.shape[0],), jnp.int32)
        (state, acc), _ = lax.scan(body, (state, acc0), jnp.arange(steps))
        return acc, state

    return jax.jit(run)


def _scan_top_p(steps: int, method: str, radix_bits: int):
    def mask(probs, top_p):
        if method == "radix":  # the radix width is a private knob, swept here only
            return sampling._top_p_radix(probs, top_p, radix_bits)
        return top_p_mask(probs, top_p, method)

    def run(probs, top_p):
        def body(acc, i):
            keep = mask(probs * (1.0 + i.astype(jnp.float32) * 1e-7), top_p)
            return acc + jnp.sum(keep, axis=-1, dtype=jnp.int32), None

        acc, _ = lax.scan(body, jnp.zeros((probs.shape[0],), jnp.int32), jnp.arange(steps))
        return acc

    return jax.jit(run)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--out", default=None, help="JSON path (default: results/bench_sampler_<platform>.json)"
    )
    parser.add_argument("--vocab", type=int, default=151936)
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    parser.add_argument("--steps", type=int, default=None, help="sample calls per timed scan")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument(
        "--methods", nargs="+", default=[sampling.TOP_P_METHOD]
        + [m for m in sampling.TOP_P_METHODS if m != sampling.TOP_P_METHOD],
        help="top-p methods; the first is used for the ReSET comparison",
    )  # fmt: skip
    parser.add_argument("--radix-bits", type=int, nargs="*", default=[3, 6],
                        help="extra radix widths timed for top_p_mask")  # fmt: skip
    args = parser.parse_args(argv)

    backend = jax.default_backend()
    plat = "gpu" if backend in ("gpu", "cuda", "rocm") else backend
    steps = args.steps or (100 if plat == "gpu" else 2)
    repeats = args.repeats or (20 if plat == "gpu" else 3)
    out = args.out or os.path.join(
        os.path.dirname(os.path.abspath(__file__)), "results", f"bench_sampler_{plat}.json"
    )
    v = args.vocab
    nl = jnp.zeros((v,), jnp.bool_).at[198].set(True)
    dnl = jnp.zeros((v,), jnp.bool_).at[271].set(True)
    samplers = {
        "temperature": Temperature(0.6, top_p=0.95),
        "reset": ReSET(t_high=1.0, t_low=0.3, tau_0=0.6349, nl_mask=nl, dnl_mask=dnl, top_p=0.95),
    }
    results = []
    t_start = time.perf_counter()
    for b in args.batch:
        # logits with a realistic spread: a few large values over a N(0, 2) body
        logits = jax.random.normal(jax.random.key(b), (b, v), jnp.float32) * 2.0
        logits = logits.at[:, :8].add(jnp.arange(8, 0, -1, dtype=jnp.float32) * 2.0)
        key = jax.random.key(0)
        row = {"batch": b}
        # end to end: temperature (entropy dead), temperature + entropy, ReSET; default top-p
        # method for all three, and the other top-p methods for plain temperature
        runs = [("temperature", args.methods[0], False), ("temperature+entropy", args.methods[0],
                True), ("reset", args.methods[0], False)]  # fmt: skip
        runs += [("temperature", m, False) for m in args.methods[1:]]
        for name, method, with_info in runs:
            smp = samplers[name.split("+")[0]]
            fn = _scan_sampler(smp, steps, method, with_info)
            t = _median_time(fn, (key, logits, sampler_init(smp, b)), repeats)
            row[f"{name}/{method}_us_per_step"] = t / steps * 1e6
        m0 = args.methods[0]
        row["reset_extra_us_per_step"] = (
            row[f"reset/{m0}_us_per_step"] - row[f"temperature/{m0}_us_per_step"]
        )
        # top-p alone on tempered probabilities
        probs = jax.nn.softmax(logits / 0.6, axis=-1)
        variants = [(m, sampling._RADIX_BITS) for m in args.methods]
        variants += [("radix", r) for r in args.radix_bits if r != sampling._RADIX_BITS]
        for method, bits in variants:
            fn = _scan_top_p(steps, method, bits)
            t = _median_time(fn, (probs, jnp.full((b,), 0.95)), repeats)
            label = f"radix{bits}" if method == "radix" else method
            row[f"top_p_mask/{label}_us_per_call"] = t / steps * 1e6
        results.append(row)
        print(json.dumps(row), flush=True)

    dev = jax.devices()[0]
    record = {
        "benchmark": "bench_sampler",
        "date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "git_sha": _git_sha(),
        "python": sys.version.split()[0],
        "jax": jax.__version__,
        "jaxlib": jax.lib.__version__ if hasattr(jax.lib, "__version__") else None,
        "platform": platform.platform(),
        "backend": backend,
        "device": getattr(dev, "device_kind", str(dev)),
        "vocab": v,
        "steps_per_scan": steps,
        "repeats": repeats,
        "default_top_p_method": sampling.TOP_P_METHOD,
        "radix_bits": sampling._RADIX_BITS,
        "method": "jitted lax.scan of `steps` sample() calls; median wall time / steps; "
        "compile and one warm-up excluded; reset_extra = reset - temperature (same top-p method; "
        "temperature's entropy is dead code there, temperature+entropy keeps it live)",
        "results": results,
        # issue 2, Done when: ReSET adds <= 10 us per decode step at B=1 (on the H200)
        "reset_extra_us_per_step_b1": next(
            (r["reset_extra_us_per_step"] for r in results if r["batch"] == 1), None
        ),
        "total_seconds": time.perf_counter() - t_start,
    }
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(record, f, indent=2)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
