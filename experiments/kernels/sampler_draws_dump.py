"""The grid sampler kernels' draws and statistics on fixed inputs, saved, so that two builds of
cuda_ops/sampler.cu (the tree's and a patched one, in two processes) compare bit for bit.

A patch that only reorders loads (as the grid sweeps' loads ahead did) must leave every token,
entropy, temperature and ReSET state word as it was; the GPU tests allow one row in a batch to differ
from the CPU emulation, so they would not see a patch that moves a rare draw.

    python3 experiments/kernels/sampler_draws_dump.py --out tree.npz        (GPU)
    git apply PATCH
    python3 experiments/kernels/sampler_draws_dump.py --out patched.npz
    python3 experiments/kernels/sampler_draws_dump.py --compare tree.npz patched.npz

Cases: "grid" and "cdf" with Temperature(0.6, top_p 0.95), Temperature with top-k 20 ("grid"),
ReSET(1.0, 0.1, top_p 0.95) on "grid", "cdf", "grid-state" and "cdf-state";
float32 and bfloat16 logits (random normal x 3, and flat: normal x 0.05); `--batch` rows (1 and
64), `--steps` keys each.
`--compare` exits 1 naming every array that differs (NaNs equal).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np

V = 151936
CASES = [  # (name, sampler kind, kernel variant)
    ("temp-grid", "temp", "grid"),
    ("temp-cdf", "temp", "cdf"),
    ("topk20-grid", "topk20", "grid"),
    ("reset-grid", "reset", "grid"),
    ("reset-cdf", "reset", "cdf"),
    ("reset-grid-state", "reset", "grid-state"),
    ("reset-cdf-state", "reset", "cdf-state"),
]


def _sampler(kind: str):
    from rejax import sampling

    if kind == "temp":
        return sampling.Temperature(t=0.6, top_p=0.95, top_p_method="kernel")
    if kind == "topk20":
        return sampling.Temperature(t=0.6, top_p=0.95, top_k=20, top_p_method="kernel")
    ids = np.arange(V)  # newline tokens: every 97th id, double newlines every 389th, so that
    # the random logits reach them and the ReSET state moves within a few steps
    return sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95, top_p_method="kernel",
                          nl_mask=ids % 97 == 0, dnl_mask=ids % 389 == 0)  # fmt: skip


def dump(batches, steps: int) -> dict[str, np.ndarray]:
    """name -> array for every case, batch, logits kind and dtype (`steps` keys each)."""
    import jax
    import jax.numpy as jnp

    from rejax import sampling
    from rejax.ops import sampler as op

    out = {}
    rng = np.random.default_rng(0)
    logits = {
        "normal": 3.0 * rng.standard_normal((max(batches), V), np.float32),
        "flat": 0.05 * rng.standard_normal((max(batches), V), np.float32),
    }
    fn = jax.jit(op.sample_kernel, static_argnames="variant")
    for name, kind, variant in CASES:
        smp = _sampler(kind)
        for b in batches:
            for lk, z in logits.items():
                for dt in ("float32", "bfloat16"):
                    zz = jnp.asarray(z[:b]).astype(dt)
                    state = sampling.sampler_init(smp, b)
                    toks, ents, temps, states = [], [], [], []
                    for s in range(steps):
                        key = jax.random.fold_in(jax.random.key(5), s)
                        tok, state, info = fn(key, zz, state, smp, variant=variant)
                        toks.append(np.asarray(tok))
                        ents.append(np.asarray(info["entropy"]))
                        temps.append(np.asarray(info["temperature"]))
                        leaves = jax.tree_util.tree_leaves(state)
                        words = [np.asarray(x, np.float64).reshape(b, -1) for x in leaves]
                        states.append(np.concatenate(words or [np.zeros((b, 0))], axis=1))
                    tag = f"{name}/b{b}/{lk}/{dt}"
                    out[f"{tag}/tokens"] = np.stack(toks)
                    out[f"{tag}/entropy"] = np.stack(ents)
                    out[f"{tag}/temperature"] = np.stack(temps)
                    out[f"{tag}/state"] = np.stack(states)
                    print(f"{tag}: tokens {out[f'{tag}/tokens'][0][:4].tolist()}...", flush=True)
    return out


def compare(a: dict, b: dict) -> list[str]:
    """Names whose arrays differ (or are in one file only)."""
    bad = sorted(set(a) ^ set(b))
    for k in sorted(set(a) & set(b)):
        if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k], equal_nan=True):
            bad.append(k)
    return bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="npz to write (runs the kernels: needs a GPU)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two dumps to compare")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 64])
    ap.add_argument("--steps", type=int, default=4, help="keys per case")
    args = ap.parse_args(argv)
    if bool(args.out) == bool(args.compare):
        ap.error("give exactly one of --out and --compare")
    if args.out and (args.steps < 1 or any(not 1 <= b <= 64 for b in args.batch)):
        ap.error(f"--steps {args.steps} and --batch {args.batch}: expected >= 1 and 1..64")
    if args.compare:
        a, b = (dict(np.load(p)) for p in args.compare)
        bad = compare(a, b)
        print(f"{len(a)} arrays, {len(bad)} differ" + "".join(f"\n  {k}" for k in bad))
        return 1 if bad else 0
    np.savez_compressed(args.out, **dump(args.batch, args.steps))
    return 0


if __name__ == "__main__":
    sys.exit(main())
