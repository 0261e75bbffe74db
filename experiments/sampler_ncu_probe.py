"""Per-kernel times of the GPU sampler under Nsight Compute ([T2-E]): which of the "split"
variant's three kernels (stats, hist, resolve) the flat-logit cost sits in.

Runs Temperature(0.6) + top-p 0.95 and top-k 20 through `rejax.sampling.sample` (method
"kernel-split") on "flat" (N(0, 1)) and "lm" (2 x Gumbel) logits at each --batch, `--calls`
times each, so that `ncu --kernel-name regex:rejax_sample --print-summary per-kernel` can
average each kernel's duration per case (NVTX-free: the cases run in a fixed order, one
jitted call each, and the script prints the order). Usage on the GPU:
  ncu --kernel-name regex:rejax_sample --metrics gpu__time_duration.sum \\
    --print-summary per-kernel python3 experiments/sampler_ncu_probe.py --batch 1 --logits flat
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp

from rejax import sampling


def _logits(kind: str, b: int, v: int) -> jax.Array:
    if kind == "flat":
        return jax.random.normal(jax.random.key(b), (b, v), jnp.float32)
    return 2.0 * jax.random.gumbel(jax.random.key(b), (b, v), jnp.float32)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1])
    ap.add_argument("--logits", nargs="+", default=["flat"], choices=["flat", "lm"])
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--calls", type=int, default=5)
    ap.add_argument("--method", default="kernel-split", choices=sampling.SAMPLE_METHODS)
    args = ap.parse_args(argv)
    samplers = {
        "temperature_top_p": sampling.Temperature(t=0.6, top_p=0.95),
        "top_k20": sampling.Temperature(t=0.6, top_k=20),
    }
    for b in args.batch:
        keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
            jax.random.key(0), jnp.arange(b, dtype=jnp.uint32)
        )
        for kind in args.logits:
            z = _logits(kind, b, args.vocab)
            for name, smp in samplers.items():
                state = sampling.sampler_init(smp, b)
                fn = jax.jit(
                    lambda k, x, s, smp=smp: sampling.sample(
                        k, x, s, smp, top_p_method=args.method
                    )[0]
                )
                for _ in range(args.calls):
                    tok = fn(keys, z, state)
                jax.block_until_ready(tok)
                print(f"case b={b} logits={kind} sampler={name}: {args.calls} calls", flush=True)


if __name__ == "__main__":
    main()
