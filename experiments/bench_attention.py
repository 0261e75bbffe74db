"""Decode attention benchmark: live-slot Pallas kernel vs reference vs the full-cache einsum.

Each variant runs inside one jitted `fori_loop` of `--steps` dependent calls (the query of call
i + 1 depends on the output of call i; the layer alternates over a [L=2, B, S, K, H] cache, so
`layer` is a traced value as in the decoder's layer scan), with `live` passed as a device
value, so one compile serves every live length (the trace count is recorded). Variants:

* pallas: `decode_attention(impl="pallas")`, reads only slots [0, live);
* cuda: `decode_attention(impl="cuda")`, the one-launch CUDA kernel (cuda_ops/decode_attention.cu),
  once per `--cuda-variants` entry (FlashOptions fields, e.g. `default splits=32,warps=8`), so
  the Pallas kernel and CUDA variants are timed in the same run;
* ref: `decode_attention(impl="ref")`, the pure-JAX reference (scores over all S slots);
* full: today's decoder attention, `rejax.layers.attention` over every slot of one layer.

Reported per call: seconds, the live K/V bytes (2 * B * live * K * H * 2 for bf16; positions
and q not counted) over that time as GB/s, and that as a fraction of a measured copy ceiling
(read + write bytes per second of an elementwise pass). A correctness phase compares the kernel
(outputs poisoned with NaN before the kernel runs; cache slots past live poisoned with NaN) with
the reference on random data: live lengths incl. 1, block and split boundaries, lengths that
are no block multiple, left padding, -1 holes, a padded query row, batch 1..64.

    PYTHONPATH=. python experiments/bench_attention.py --out OUT.json   # GPU, full sweep
    PYTHONPATH=. python experiments/bench_attention.py --impls pallas cuda \
        --cuda-variants default splits=32 min_ctas=4 --out OUT.json     # Pallas vs CUDA
    PYTHONPATH=. python experiments/bench_attention.py --tiny --out /tmp/bench_attention_tiny.json

A prefill phase times `prefill_attention` (chunked, B = 1, T = S) against today's attention
that holds [B, N, T, S] float32 scores, with XLA's temporary bytes for each.

`--tiny` runs small shapes with the kernel in Pallas interpret mode (a CPU check of the script).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from cuda_ops.decode_attention import FlashOptions
from rejax.bench import versions
from rejax.layers import attention, attention_mask
from rejax.ops.decode_attention import (
    BLOCK_S,
    cuda_problem,
    decode_attention,
    decode_attention_cuda,
    decode_attention_kernel,
    default_num_splits,
    prefill_attention,
)

# kernel vs reference, bf16 out: norm(y - ref) / norm(ref) over rows with a visible key
REL_TOL = 1e-2


# ----------------------------------------------------------------------------- helpers


def _time(fn, repeats: int) -> float:
    """Median seconds of `repeats` calls after one warm-up call (compilation excluded)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_ceiling(nbytes: int, repeats: int) -> float:
    """Device read+write bandwidth (bytes/s) of an elementwise pass over `nbytes` bytes."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1))
    return 2 * x.size * 4 / _time(lambda: f(x), repeats)


@functools.partial(jax.jit, static_argnames=("b", "s", "n", "kh", "h", "layers", "poison"))
def _problem(key, live, *, b, s, n, kh, h, layers, poison):
    """Random bf16 q and cache; per-row left padding, 5% -1 holes, the last row a padded query.

    Returns (q, k_cache, v_cache, q_positions, k_positions).
    """
    ks = jax.random.split(key, 6)
    q = jax.random.normal(ks[0], (b, n, h), jnp.bfloat16)
    k_cache = jax.random.normal(ks[1], (layers, b, s, kh, h), jnp.bfloat16)
    v_cache = jax.random.normal(ks[2], (layers, b, s, kh, h), jnp.bfloat16)
    slot = jnp.arange(s)
    pad = jax.random.randint(ks[3], (b,), 0, jnp.maximum(1, live // 3))
    pos = slot[None, :] - pad[:, None]  # [B, S]
    holes = jax.random.uniform(ks[4], (b, s)) < 0.05
    k_pos = jnp.where((slot < live) & (pos >= 0) & ~holes, pos, -1)
    q_pos = jnp.maximum(live - 1 - pad - jax.random.randint(ks[5], (b,), 0, 3), 0)
    q_pos = jnp.minimum(q_pos, jnp.maximum(live - 1 - pad, 0))
    # the query's own slot holds its token (the decoder writes it before attending)
    k_pos = jnp.where(slot[None, :] == (q_pos + pad)[:, None], q_pos[:, None], k_pos)
    if b > 1:
        q_pos = q_pos.at[b - 1].set(-1)
    if poison:
        past = (slot >= live)[None, None, :, None, None]
        k_cache = jnp.where(past, jnp.nan, k_cache).astype(jnp.bfloat16)
        v_cache = jnp.where(past, jnp.nan, v_cache).astype(jnp.bfloat16)
    return q, k_cache, v_cache, q_pos.astype(jnp.int32), k_pos.astype(jnp.int32)


def parse_variant(text: str) -> FlashOptions:
    """ "default" or comma-separated FlashOptions fields, e.g. "splits=32,warps=8"."""
    if text == "default":
        return FlashOptions()
    fields = {}
    for item in text.split(","):
        key, _, value = item.partition("=")
        if key not in FlashOptions.__dataclass_fields__ or not value.lstrip("-").isdigit():
            raise SystemExit(
                f"--cuda-variants: {item!r}, expected NAME=INT with NAME in "
                f"{sorted(FlashOptions.__dataclass_fields__)}"
            )
        fields[key] = int(value)
    return FlashOptions(**fields)


def _attention_fn(impl: str, block_s: int, num_splits: int | None, cuda: FlashOptions = None):
    if impl == "cuda":
        return functools.partial(decode_attention, impl="cuda", cuda_options=cuda)
    if impl == "full":
        # today's decoder: a per-layer cache array (static index) and a mask over every slot
        def full(q, k_cache, v_cache, layer, q_positions, k_positions, live):
            del layer, live
            mask = attention_mask(q_positions[:, None], k_positions)
            return attention(q[:, None], k_cache[1], v_cache[1], mask)[:, 0]

        return full
    return functools.partial(decode_attention, impl=impl, block_s=block_s, num_splits=num_splits)


def _loop(fn, steps: int, counter: list):
    """A jitted fori_loop of `steps` dependent attention calls; live and the cache are args."""

    def run(q0, k_cache, v_cache, q_positions, k_positions, live):
        counter[0] += 1
        n_layers = k_cache.shape[0]

        def body(i, q):
            layer = (i % n_layers).astype(jnp.int32)
            y = fn(q, k_cache, v_cache, layer, q_positions, k_positions, live)
            return (q + 1e-3 * y).astype(q.dtype)

        return jax.lax.fori_loop(0, steps, body, q0)

    return jax.jit(run)


# ----------------------------------------------------------------------------- phases


def run_timings(args, kernel_impl: str, ceiling: float) -> list[dict]:
    n, kh, h = args.heads
    rows = []
    for s in args.slots:
        for b in args.batch:
            lives = [x for x in args.live if x <= s]
            if not lives:
                continue
            q, kc, vc, _, _ = _problem(
                jax.random.key(s + b),
                jnp.int32(s),
                b=b,
                s=s,
                n=n,
                kh=kh,
                h=h,
                layers=2,
                poison=False,
            )
            slot = jnp.arange(s)
            variants = []
            for impl in args.impls:
                if impl == "cuda":
                    variants += [
                        (f"cuda[{v}]", "cuda", parse_variant(v)) for v in args.cuda_variants
                    ]
                else:
                    variants.append((impl, kernel_impl if impl == "pallas" else impl, None))
            for impl, impl_name, cuda in variants:
                counter = [0]
                fn = _attention_fn(impl_name, args.block_s, args.num_splits, cuda)
                f = _loop(fn, args.steps, counter)
                for live in lives:
                    k_pos = jnp.broadcast_to(jnp.where(slot < live, slot, -1), (b, s))
                    q_pos = jnp.full((b,), live - 1, jnp.int32)
                    live_dev = jnp.int32(live)
                    t0 = time.perf_counter()
                    try:
                        xs = (q, kc, vc, q_pos, k_pos, live_dev)
                        t = _time(lambda f=f, xs=xs: f(*xs), args.repeats)
                    except Exception as err:  # noqa: BLE001 - record, keep the sweep going
                        rows.append(
                            {"S": s, "B": b, "live": live, "impl": impl, "error": repr(err)}
                        )
                        print(f"S={s} B={b} live={live} {impl}: {err!r}", flush=True)
                        continue
                    per_call = t / args.steps
                    live_bytes = 2 * b * live * kh * h * kc.dtype.itemsize
                    row = {
                        "S": s,
                        "B": b,
                        "live": live,
                        "impl": impl,
                        "s_per_call": per_call,
                        "us_per_call": per_call * 1e6,
                        "live_kv_bytes": live_bytes,
                        "GBps_live": live_bytes / per_call / 1e9,
                        "frac_copy_ceiling": live_bytes / per_call / ceiling,
                        "traces_so_far": counter[0],
                        "wall_s": time.perf_counter() - t0,
                    }
                    if impl == "pallas":
                        row["num_splits"] = args.num_splits or default_num_splits(
                            b, kh, s, args.block_s
                        )
                    if cuda is not None:
                        shape, _ = cuda_problem(q, kc, vc, None, cuda)
                        row["cuda_shape"] = dataclasses.asdict(shape)
                    rows.append(row)
                    print(
                        f"S={s:6d} B={b:2d} live={live:6d} {impl:6s} {row['us_per_call']:9.1f} us "
                        f"{row['GBps_live']:8.1f} GB/s live "
                        f"({row['frac_copy_ceiling']:.0%} of copy)"
                        f" traces={counter[0]}",
                        flush=True,
                    )
    return rows


def _check_lives(s: int, block_s: int, num_splits: int, rng) -> list[int]:
    """Live lengths: 1, block and split boundaries +-1, S, and random lengths."""
    per_split = max(-(-s // block_s // num_splits), 2) * block_s
    cand = {1, 2, block_s - 1, block_s, block_s + 1, per_split - 1, per_split, per_split + 1}
    cand |= {s - 1, s, 3 * per_split + 7}
    cand |= {int(x) for x in rng.integers(1, s + 1, 3)}
    return sorted(x for x in cand if 1 <= x <= s)


def run_check(args, kernel_impl: str) -> dict:
    n, kh, h = args.heads
    rng = np.random.default_rng(0)
    cases, failures = [], 0
    for b, s in args.check_shapes:
        splits = args.num_splits or default_num_splits(b, kh, s, args.block_s)
        for live in _check_lives(s, args.block_s, splits, rng):
            q, kc, vc, qp, kp = _problem(
                jax.random.key(live * 7 + b),
                jnp.int32(live),
                b=b,
                s=s,
                n=n,
                kh=kh,
                h=h,
                layers=2,
                poison=True,
            )
            xs = (q, kc, vc, jnp.int32(1), qp, kp, jnp.int32(live))
            ref = decode_attention(*xs, impl="ref")
            if kernel_impl == "interpret":
                out = decode_attention_kernel(
                    *xs, block_s=args.block_s, num_splits=splits, interpret=True, poison=True
                )
            else:
                out = jax.jit(
                    functools.partial(
                        decode_attention_kernel,
                        block_s=args.block_s,
                        num_splits=splits,
                        poison=True,
                    )
                )(*xs)
            outs = {"pallas": out}
            if "cuda" in args.impls and kernel_impl != "interpret":
                for v in args.cuda_variants:
                    fn = functools.partial(
                        decode_attention_cuda, options=parse_variant(v), poison=True
                    )
                    outs[f"cuda[{v}]"] = jax.jit(fn)(*xs)
            ref = np.asarray(ref, np.float32)
            kp_np, qp_np = np.asarray(kp)[:, :live], np.asarray(qp)
            vis = ((kp_np >= 0) & (kp_np <= qp_np[:, None])).any(axis=1)
            for name, out in outs.items():
                out = np.asarray(out, np.float32)
                rel = float(np.linalg.norm(out[vis] - ref[vis]) / np.linalg.norm(ref[vis]))
                hidden_zero = bool(np.all(out[~vis] == 0))
                finite = bool(np.isfinite(out).all())
                ok = rel <= REL_TOL and hidden_zero and finite
                failures += not ok
                cases.append(
                    {
                        "B": b,
                        "S": s,
                        "live": live,
                        "kernel": name,
                        "num_splits": splits,
                        "rel_err": rel,
                        "hidden_rows_zero": hidden_zero,
                        "finite": finite,
                        "ok": ok,
                    }
                )
                print(
                    f"check {name} B={b} S={s} live={live}: rel {rel:.2e} {'ok' if ok else 'FAIL'}",
                    flush=True,
                )
    return {"tolerance": REL_TOL, "failures": failures, "cases": cases}


def _temp_bytes(jitted, *xs) -> int | None:
    """XLA's temporary-buffer bytes for the compiled program (None if not reported)."""
    try:
        return int(jitted.lower(*xs).compile().memory_analysis().temp_size_in_bytes)
    except Exception:  # noqa: BLE001 - not every backend reports it
        return None


def run_prefill(args) -> list[dict]:
    """Prompt attention: chunked `prefill_attention` vs today's [B, N, T, S] attention."""
    n, kh, h = args.heads
    rows = []
    for t in args.prefill_lens:
        ks = jax.random.split(jax.random.key(t), 3)
        q = jax.random.normal(ks[0], (1, t, n, h), jnp.bfloat16)
        k = jax.random.normal(ks[1], (1, t, kh, h), jnp.bfloat16)
        v = jax.random.normal(ks[2], (1, t, kh, h), jnp.bfloat16)
        pos = jnp.arange(t, dtype=jnp.int32)[None]
        variants = {"chunked": jax.jit(prefill_attention)}
        score_bytes = n * t * t * 4
        if score_bytes <= args.max_score_gib << 30:
            variants["full"] = jax.jit(
                lambda q, k, v, qp, kp: attention(q, k, v, attention_mask(qp, kp))
            )
        outs = {}
        for name, f in variants.items():
            xs = (q, k, v, pos, pos)
            sec = _time(lambda f=f, xs=xs: f(*xs), args.repeats)
            outs[name] = np.asarray(f(*xs), np.float32)
            rows.append(
                {
                    "T": t,
                    "impl": name,
                    "s": sec,
                    "temp_bytes": _temp_bytes(f, *xs),
                    "full_scores_bytes": score_bytes,
                }
            )
            print(f"prefill T={t} {name}: {sec * 1e3:.2f} ms", flush=True)
        if "full" in outs:
            ref = outs["full"]
            rows[-2]["rel_err_vs_full"] = float(
                np.linalg.norm(outs["chunked"] - ref) / np.linalg.norm(ref)
            )
    return rows


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument("--slots", nargs="+", type=int, default=[1536, 8192, 33280])
    ap.add_argument("--live", nargs="+", type=int, default=[1024, 8192, 32768])
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--heads", nargs=3, type=int, default=[32, 8, 128], metavar=("N", "K", "H"))
    ap.add_argument(
        "--impls",
        nargs="+",
        default=["pallas", "ref", "full"],
        choices=["pallas", "cuda", "ref", "full"],
    )
    ap.add_argument(
        "--cuda-variants",
        nargs="+",
        default=["default"],
        help="launch choices of the cuda impl: 'default' or FlashOptions fields, e.g. "
        "splits=32,warps=8,unroll=2,min_tiles=1,min_ctas=4 (each one a timed variant)",
    )
    ap.add_argument("--steps", type=int, default=64, help="attention calls per timed loop")
    ap.add_argument("--repeats", type=int, default=5, help="timed loops (median)")
    ap.add_argument("--block-s", type=int, default=BLOCK_S)
    ap.add_argument("--num-splits", type=int, default=None, help="default: default_num_splits")
    ap.add_argument(
        "--check-shapes",
        nargs="+",
        default=["1x33280", "3x1536", "8x8192", "64x1536"],
        help="BxS cases for the correctness phase",
    )
    ap.add_argument("--no-check", action="store_true")
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument(
        "--prefill-lens",
        nargs="*",
        type=int,
        default=[2048, 8192],
        help="prompt lengths for the prefill phase (none: skip it)",
    )
    ap.add_argument(
        "--max-score-gib",
        type=int,
        default=16,
        help="skip today's prefill attention when its scores exceed this",
    )
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy-ceiling buffer size")
    ap.add_argument("--tiny", action="store_true", help="small shapes, interpret kernel (CPU)")
    args = ap.parse_args(argv)
    if args.tiny:
        args.slots, args.live, args.batch = [64, 200], [16, 100], [1, 2]
        args.heads, args.steps, args.repeats, args.copy_mib = [8, 2, 32], 2, 1, 16
        args.check_shapes, args.block_s = ["1x200", "3x64"], 16
        args.prefill_lens = [40]
    try:
        args.check_shapes = [tuple(int(v) for v in c.split("x")) for c in args.check_shapes]
    except ValueError:
        raise SystemExit(f"--check-shapes takes BxS pairs like 8x8192, got {args.check_shapes}")
    if args.heads[0] % args.heads[1]:
        raise SystemExit(f"--heads: N={args.heads[0]} must be a multiple of K={args.heads[1]}")
    for v in args.cuda_variants:
        parse_variant(v)  # bad variants fail before any work
    kernel_impl = "interpret" if args.tiny else "pallas"
    if args.tiny and "cuda" in args.impls:
        print("--tiny: the cuda impl needs a GPU; dropped", flush=True)
        args.impls = [i for i in args.impls if i != "cuda"]
    if kernel_impl == "pallas" and jax.default_backend() != "gpu":
        raise SystemExit("the kernel needs a CUDA GPU; use --tiny for a CPU run")
    result = {
        "args": {k: v for k, v in vars(args).items()},
        "versions": dict(
            versions(), platform_version=str(jax.devices()[0].client.platform_version)
        ),
        "kernel_impl": kernel_impl,
        "bytes_note": "live_kv_bytes = K and V of slots [0, live) of one layer: "
        "2 * B * live * K * H * itemsize; GBps_live divides it by the time per call for every "
        "variant (the ref and full variants read all S slots)",
    }
    result["copy_ceiling_GBps"] = copy_ceiling(args.copy_mib << 20, max(args.repeats, 3)) / 1e9
    print(f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s", flush=True)
    ceiling = result["copy_ceiling_GBps"] * 1e9
    if not args.no_check:
        result["check"] = run_check(args, kernel_impl)
        _write(args.out, result)
    if not args.no_timing:
        result["timings"] = run_timings(args, kernel_impl, ceiling)
        _write(args.out, result)
    if args.prefill_lens:
        result["prefill"] = run_prefill(args)
    _write(args.out, result)
    print(f"wrote {args.out}")
    if result.get("check", {}).get("failures"):
        print(f"{result['check']['failures']} check failures", file=sys.stderr)
    return result


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
