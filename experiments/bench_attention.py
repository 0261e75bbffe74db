"""Decode attention benchmark: live-slot Pallas kernel vs reference vs the full-cache einsum.

Each variant runs inside one jitted `fori_loop` of `--steps` iterations; each iteration is a
Python-unrolled chain of `--unroll` U dependent calls (the output of call j is the query of
call j + 1; the layer alternates over a [L=2, B, S, K, H] cache and is a traced value, as in the
decoder's layer scan) followed by one negation of q. `live` is a device value, so one compile
serves every live length (the trace count is recorded). The loop itself costs something per
iteration (XLA's GPU while loop: the predicate goes to the host, a few to ~10 us), so a control
loop of the same structure without the attention calls (the negation alone) is timed for each
(S, B), and every row reports both:

* raw: loop time / (steps * U), the loop's own cost and the negation spread over U calls;
* net: (loop time - control loop time) / (steps * U), attention alone.

GB/s and the share of the copy ceiling are given for both; the time at one live slot is the
fixed cost (`fixed_us_net`), and `GBps_above_fixed` is the live bytes over the net time above
it. Variants:

* pallas: `decode_attention(impl="pallas")`, reads only slots [0, live); once per
  `--pallas-variants` entry ("default" or comma-separated launch choices block_s, splits,
  warps, stages, blocks, prefetch, e.g. `warps=8,stages=3 blocks=2 prefetch=1`);
* cuda: `decode_attention(impl="cuda")`, the one-launch CUDA kernel (cuda_ops/decode_attention.cu),
  once per `--cuda-variants` entry (FlashOptions fields, e.g. `default splits=32,warps=8`), so
  the Pallas kernel and CUDA variants are timed in the same run;
* ref: `decode_attention(impl="ref")`, the pure-JAX reference (scores over all S slots);
* full: today's decoder attention, `rejax.layers.attention` over every slot of one layer.

Reported per call: seconds, the live K/V bytes (2 * B * live * K * H * 2 for bf16; positions
and q not counted) over that time as GB/s, and that as a fraction of a measured copy ceiling
(read + write bytes per second of an elementwise pass; a read-only ceiling, a sum over the
same buffer, is recorded next to it). A correctness phase compares each kernel variant (outputs
poisoned with NaN before the kernel runs; cache slots past live poisoned with NaN) with the
reference on random data: live lengths incl. 1, each variant's block and split boundaries,
lengths that are no block multiple, left padding, -1 holes, a padded query row, batch 1..64.

    PYTHONPATH=. python experiments/bench_attention.py --out OUT.json   # GPU, full sweep
    PYTHONPATH=. python experiments/bench_attention.py --impls pallas cuda \
        --cuda-variants default splits=32 min_ctas=4 --out OUT.json     # Pallas vs CUDA
    PYTHONPATH=. python experiments/bench_attention.py --impls pallas --slots 33280 \
        --live 1 1024 8192 32768 --pallas-variants default warps=8 stages=3 --out OUT.json
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
    NUM_STAGES,
    NUM_WARPS,
    check_launch,
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


def read_ceiling(nbytes: int, repeats: int) -> float:
    """Device read bandwidth (bytes/s) of a sum over `nbytes` bytes (attention only reads)."""
    x = jnp.ones((nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda a: jnp.sum(a, dtype=jnp.uint32))
    return x.size * 4 / _time(lambda: f(x), repeats)


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


# --pallas-variants field -> decode_attention argument
PALLAS_FIELDS = {
    "block_s": "block_s",
    "splits": "num_splits",
    "warps": "num_warps",
    "stages": "num_stages",
    "blocks": "blocks_per_iter",
    "prefetch": "prefetch",
}


def parse_pallas_variant(text: str, block_s: int, num_splits: int | None) -> dict:
    """ "default" or comma-separated launch choices ("warps=8,stages=3") -> the Pallas kernel's
    keyword arguments (`decode_attention` names); fields not given take the defaults, block_s
    and splits those of --block-s / --num-splits. Bad values exit with the kernel's message."""
    launch = {
        "block_s": block_s,
        "num_splits": num_splits,
        "num_warps": NUM_WARPS,
        "num_stages": NUM_STAGES,
        "blocks_per_iter": 1,
        "prefetch": False,
    }
    for item in [] if text == "default" else text.split(","):
        key, _, value = item.partition("=")
        if key not in PALLAS_FIELDS or not value.lstrip("-").isdigit():
            raise SystemExit(
                f"--pallas-variants: {item!r} in {text!r}, expected 'default' or NAME=INT with "
                f"NAME in {sorted(PALLAS_FIELDS)}"
            )
        launch[PALLAS_FIELDS[key]] = int(value)
    if launch["prefetch"] not in (0, 1):
        raise SystemExit(f"--pallas-variants: prefetch takes 0 or 1, got {text!r}")
    launch["prefetch"] = bool(launch["prefetch"])
    try:
        check_launch(**launch)
    except ValueError as err:
        raise SystemExit(f"--pallas-variants {text!r}: {err}") from None
    return launch


def _resolved(launch: dict, b: int, kh: int, s: int) -> dict:
    """launch with num_splits filled in (default_num_splits when None)."""
    splits = launch["num_splits"] or default_num_splits(b, kh, s, launch["block_s"])
    return dict(launch, num_splits=splits)


def _attention_fn(impl: str, launch: dict | None = None, cuda: FlashOptions = None):
    if impl == "cuda":
        return functools.partial(decode_attention, impl="cuda", cuda_options=cuda)
    if impl == "full":
        # today's decoder: a per-layer cache array (static index) and a mask over every slot
        def full(q, k_cache, v_cache, layer, q_positions, k_positions, live):
            del layer, live
            mask = attention_mask(q_positions[:, None], k_positions)
            return attention(q[:, None], k_cache[1], v_cache[1], mask)[:, 0]

        return full
    return functools.partial(decode_attention, impl=impl, **(launch or {}))


def _loop(fn, steps: int, unroll: int, counter: list):
    """A jitted fori_loop of `steps` iterations, each `unroll` dependent attention calls (the
    output is the next query) and one negation of q; fn None: the control loop, the negation
    alone. live and the cache are arguments."""

    def run(q0, k_cache, v_cache, q_positions, k_positions, live):
        counter[0] += 1
        n_layers = k_cache.shape[0]

        def body(i, q):
            for j in range(unroll if fn is not None else 0):
                layer = ((i * unroll + j) % n_layers).astype(jnp.int32)
                q = fn(q, k_cache, v_cache, layer, q_positions, k_positions, live).astype(q.dtype)
            # one small XLA op per iteration in both loops, so the control loop has a body
            return -q

        return jax.lax.fori_loop(0, steps, body, q0)

    return jax.jit(run)


def _while_loops(f, *xs) -> int | None:
    """While loops left in the compiled program (XLA may unroll a small loop; None: unknown)."""
    try:
        return f.lower(*xs).compile().as_text().count(" while(")
    except Exception:  # noqa: BLE001 - diagnostics only
        return None


# ----------------------------------------------------------------------------- phases


def _variants(args, kernel_impl: str) -> list[tuple[str, str, dict | None, FlashOptions | None]]:
    """(name, impl, Pallas launch, CUDA options) for every timed variant."""
    out = []
    for impl in args.impls:
        if impl == "cuda":
            out += [(f"cuda[{v}]", "cuda", None, parse_variant(v)) for v in args.cuda_variants]
        elif impl == "pallas":
            for v in args.pallas_variants:
                name = "pallas" if v == "default" else f"pallas[{v}]"
                launch = parse_pallas_variant(v, args.block_s, args.num_splits)
                out.append((name, kernel_impl, launch, None))
        else:
            out.append((impl, impl, None, None))
    return out


def _over_budget(args, t_start: float) -> bool:
    return args.budget_s is not None and time.perf_counter() - t_start > args.budget_s


def run_timings(args, kernel_impl: str, ceiling: float, t_start: float, result: dict) -> list[dict]:
    """Timed loops per (S, B, variant, live); rows also land in result["timings"], written to
    --out after each variant."""
    n, kh, h = args.heads
    calls = args.steps * args.unroll
    rows = result["timings"] = []
    for s in args.slots:
        for b in args.batch:
            lives = [x for x in args.live if x <= s]
            if not lives:
                continue
            if _over_budget(args, t_start):
                rows.append({"S": s, "B": b, "skipped": "--budget-s reached"})
                print(f"S={s} B={b}: skipped, --budget-s reached", flush=True)
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
            k_pos = jnp.broadcast_to(jnp.where(slot < 1, slot, -1), (b, s))
            xs0 = (q, kc, vc, jnp.zeros((b,), jnp.int32), k_pos, jnp.int32(1))
            control = _loop(None, args.steps, args.unroll, [0])
            t_ctrl = _time(lambda f=control, xs=xs0: f(*xs), args.repeats)
            ctrl_loops = _while_loops(control, *xs0)
            print(
                f"S={s:6d} B={b:2d} control loop {t_ctrl / args.steps * 1e6:7.2f} us per "
                f"iteration ({t_ctrl / calls * 1e6:.2f} us per call slot; while loops left: "
                f"{ctrl_loops})",
                flush=True,
            )
            for name, impl_name, launch, cuda in _variants(args, kernel_impl):
                if _over_budget(args, t_start):
                    rows.append({"S": s, "B": b, "impl": name, "skipped": "--budget-s reached"})
                    print(f"S={s} B={b} {name}: skipped, --budget-s reached", flush=True)
                    continue
                counter = [0]
                launch = launch and _resolved(launch, b, kh, s)
                f = _loop(_attention_fn(impl_name, launch, cuda), args.steps, args.unroll, counter)
                fixed = None
                for live in lives:
                    k_pos = jnp.broadcast_to(jnp.where(slot < live, slot, -1), (b, s))
                    q_pos = jnp.full((b,), live - 1, jnp.int32)
                    xs = (q, kc, vc, q_pos, k_pos, jnp.int32(live))
                    t0 = time.perf_counter()
                    try:
                        t = _time(lambda f=f, xs=xs: f(*xs), args.repeats)
                    except Exception as err:  # noqa: BLE001 - record, keep the sweep going
                        rows.append(
                            {"S": s, "B": b, "live": live, "impl": name, "error": repr(err)}
                        )
                        print(f"S={s} B={b} live={live} {name}: {err!r}", flush=True)
                        break  # a variant that fails (e.g. does not compile) fails at every live
                    per_call, net = t / calls, (t - t_ctrl) / calls
                    live_bytes = 2 * b * live * kh * h * kc.dtype.itemsize
                    row = {
                        "S": s,
                        "B": b,
                        "live": live,
                        "impl": name,
                        "unroll": args.unroll,
                        "steps": args.steps,
                        "s_per_call": per_call,
                        "us_per_call": per_call * 1e6,
                        "us_per_call_net": net * 1e6,
                        "control_us_per_iter": t_ctrl / args.steps * 1e6,
                        "live_kv_bytes": live_bytes,
                        "GBps_live": live_bytes / per_call / 1e9,
                        "frac_copy_ceiling": live_bytes / per_call / ceiling,
                        "GBps_live_net": live_bytes / net / 1e9 if net > 0 else None,
                        "frac_copy_ceiling_net": live_bytes / net / ceiling if net > 0 else None,
                        "traces_so_far": counter[0],
                        "wall_s": time.perf_counter() - t0,
                    }
                    if live == 1:
                        fixed = net
                    if fixed is not None:
                        row["fixed_us_net"] = fixed * 1e6
                        if live > 1 and net > fixed:
                            row["GBps_above_fixed"] = live_bytes / (net - fixed) / 1e9
                    if live == lives[0]:
                        row["while_loops_left"] = [ctrl_loops, _while_loops(f, *xs)]
                    if launch is not None:
                        row["launch"] = launch
                        row["num_splits"] = launch["num_splits"]
                    if cuda is not None:
                        shape, _ = cuda_problem(q, kc, vc, None, cuda)
                        row["cuda_shape"] = dataclasses.asdict(shape)
                    rows.append(row)
                    frac_net = row["frac_copy_ceiling_net"]
                    print(
                        f"S={s:6d} B={b:2d} live={live:6d} {name:24s} raw {per_call * 1e6:8.2f} us "
                        f"net {net * 1e6:8.2f} us {row['GBps_live_net'] or 0:8.1f} GB/s net "
                        f"({frac_net or 0:.0%} of copy; raw {row['frac_copy_ceiling']:.0%})"
                        f" traces={counter[0]}",
                        flush=True,
                    )
                _write(args.out, result)
    return rows


def summary(rows: list[dict], lives: list[int]) -> str:
    """Per (S, B, variant): net us per call at each live length (raw in parentheses), and the
    net share of the copy ceiling at the longest live lengths."""
    lines = []
    keyed = {}
    for r in rows:
        if "us_per_call" in r:
            keyed.setdefault((r["S"], r["B"], r["impl"]), {})[r["live"]] = r
    if not keyed:
        return "no timings"
    shown = sorted({lv for v in keyed.values() for lv in v} & set(lives))
    big = [lv for lv in shown if lv >= 8192] or shown[-1:]
    head = f"{'S':>6s} {'B':>3s} {'variant':28s}" + "".join(
        f" {'live ' + str(lv):>17s}" for lv in shown
    )
    head += "".join(f" {'%copy ' + str(lv):>11s}" for lv in big)
    lines.append("us per call, net of the control loop (raw):")
    lines.append(head)
    for (s, b, name), by_live in keyed.items():
        line = f"{s:6d} {b:3d} {name:28s}"
        for lv in shown:
            r = by_live.get(lv)
            cell = "-" if r is None else f"{r['us_per_call_net']:.2f} ({r['us_per_call']:.2f})"
            line += f" {cell:>17s}"
        for lv in big:
            r = by_live.get(lv)
            frac = None if r is None else r["frac_copy_ceiling_net"]
            line += f" {'-' if frac is None else f'{frac:.0%}':>11s}"
        lines.append(line)
    return "\n".join(lines)


def _check_lives(s: int, block_s: int, num_splits: int, rng) -> list[int]:
    """Live lengths: 1, block and split boundaries +-1, S, and random lengths."""
    per_split = max(-(-s // block_s // num_splits), 2) * block_s
    cand = {1, 2, block_s - 1, block_s, block_s + 1, per_split - 1, per_split, per_split + 1}
    cand |= {s - 1, s, 3 * per_split + 7}
    cand |= {int(x) for x in rng.integers(1, s + 1, 3)}
    return sorted(x for x in cand if 1 <= x <= s)


def run_check(args, kernel_impl: str) -> dict:
    """Each Pallas variant (and CUDA variant) against the reference, outputs poisoned."""
    n, kh, h = args.heads
    rng = np.random.default_rng(0)
    pallas = [v for v in _variants(args, kernel_impl) if v[2] is not None]
    cuda = [v for v in _variants(args, kernel_impl) if v[3] is not None]
    if kernel_impl == "interpret":
        cuda = []
    cases, failures = [], 0
    for b, s in args.check_shapes:
        launches = {name: _resolved(launch, b, kh, s) for name, _, launch, _ in pallas}
        # one jitted kernel per variant and shape (live is a device value: one compile)
        kernels = {
            name: functools.partial(
                decode_attention_kernel,
                **launch,
                poison=True,
                interpret=kernel_impl == "interpret",
            )
            for name, launch in launches.items()
        }
        if kernel_impl != "interpret":
            kernels = {name: jax.jit(fn) for name, fn in kernels.items()}
        for name, _, _, options in cuda:
            kernels[name] = jax.jit(
                functools.partial(decode_attention_cuda, options=options, poison=True)
            )
        # live lengths at every variant's block and split boundaries
        lives = set()
        for launch in {(x["block_s"], x["num_splits"]) for x in launches.values()}:
            lives |= set(_check_lives(s, *launch, rng))
        for live in sorted(lives):
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
            ref = np.asarray(decode_attention(*xs, impl="ref"), np.float32)
            kp_np, qp_np = np.asarray(kp)[:, :live], np.asarray(qp)
            vis = ((kp_np >= 0) & (kp_np <= qp_np[:, None])).any(axis=1)
            for name, fn in kernels.items():
                try:
                    out = np.asarray(fn(*xs), np.float32)
                except Exception as err:  # noqa: BLE001 - record, keep checking the others
                    failures += 1
                    cases.append({"B": b, "S": s, "live": live, "kernel": name, "error": repr(err)})
                    print(f"check {name} B={b} S={s} live={live}: {err!r}", flush=True)
                    continue
                rel = float(np.linalg.norm(out[vis] - ref[vis]) / np.linalg.norm(ref[vis]))
                hidden_zero = bool(np.all(out[~vis] == 0))
                finite = bool(np.isfinite(out).all())
                ok = rel <= REL_TOL and hidden_zero and finite
                failures += not ok
                case = {
                    "B": b,
                    "S": s,
                    "live": live,
                    "kernel": name,
                    "rel_err": rel,
                    "hidden_rows_zero": hidden_zero,
                    "finite": finite,
                    "ok": ok,
                }
                if name in launches:
                    case["launch"] = launches[name]
                    case["num_splits"] = launches[name]["num_splits"]
                cases.append(case)
                if not ok or args.verbose_check:
                    print(
                        f"check {name} B={b} S={s} live={live}: rel {rel:.2e} "
                        f"{'ok' if ok else 'FAIL'}",
                        flush=True,
                    )
        n_bad = sum(not c.get("ok", False) for c in cases if c["S"] == s and c["B"] == b)
        print(f"check B={b} S={s}: {len(lives)} lives x {len(kernels)} kernels, {n_bad} failures")
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
    ap.add_argument(
        "--live",
        nargs="+",
        type=int,
        default=[1, 1024, 8192, 32768],
        help="live lengths; 1 gives the fixed cost",
    )
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
        "splits=32,warps=8,unroll=2,min_tiles=1,min_ctas=4,prefetch=1 (each one a timed "
        "variant)",
    )
    ap.add_argument(
        "--pallas-variants",
        nargs="+",
        default=["default"],
        help="launch choices of the pallas impl: 'default' or comma-separated "
        f"{'/'.join(PALLAS_FIELDS)}=INT, e.g. block_s=128,stages=1 warps=8 blocks=2 prefetch=1 "
        "(each one checked and timed; unset fields take the defaults and --block-s / "
        "--num-splits)",
    )
    ap.add_argument("--steps", type=int, default=8, help="loop iterations per timed loop")
    ap.add_argument(
        "--unroll",
        type=int,
        default=16,
        help="U: dependent attention calls per loop iteration (the loop's cost is spread over U)",
    )
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
    ap.add_argument("--verbose-check", action="store_true", help="print every check case")
    ap.add_argument(
        "--budget-s",
        type=float,
        default=None,
        help="start no new (S, B) or variant timing after this many seconds (JSON is written "
        "as it goes; skipped ones are recorded)",
    )
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
        args.slots, args.live, args.batch = [64, 200], [1, 16, 100], [1, 2]
        args.heads, args.steps, args.repeats, args.copy_mib = [8, 2, 32], 2, 1, 16
        args.unroll = min(args.unroll, 2)
        args.check_shapes, args.block_s = ["1x200", "3x64"], 16
        args.prefill_lens = [40]
    try:
        args.check_shapes = [tuple(int(v) for v in c.split("x")) for c in args.check_shapes]
    except ValueError:
        raise SystemExit(f"--check-shapes takes BxS pairs like 8x8192, got {args.check_shapes}")
    if args.heads[0] % args.heads[1]:
        raise SystemExit(f"--heads: N={args.heads[0]} must be a multiple of K={args.heads[1]}")
    if args.steps < 1 or args.unroll < 1:
        raise SystemExit(f"--steps and --unroll must be >= 1, got {args.steps} {args.unroll}")
    for v in args.cuda_variants:
        parse_variant(v)  # bad variants fail before any work
    for v in args.pallas_variants:
        parse_pallas_variant(v, args.block_s, args.num_splits)
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
        "unroll": args.unroll,
        "timing_note": "each timed loop runs `steps` iterations of `unroll` dependent calls and "
        "one negation of q; us_per_call = loop time / (steps * unroll) (raw: includes the "
        "loop's per-iteration cost), us_per_call_net subtracts a control loop of the same "
        "structure without the attention calls (attention alone); *_net bandwidths use the net "
        "time; fixed_us_net is the net time at live 1",
    }
    t_start = time.perf_counter()
    result["copy_ceiling_GBps"] = copy_ceiling(args.copy_mib << 20, max(args.repeats, 3)) / 1e9
    result["read_ceiling_GBps"] = read_ceiling(args.copy_mib << 20, max(args.repeats, 3)) / 1e9
    print(
        f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s (read-only "
        f"{result['read_ceiling_GBps']:.0f} GB/s)",
        flush=True,
    )
    ceiling = result["copy_ceiling_GBps"] * 1e9
    if not args.no_check:
        result["check"] = run_check(args, kernel_impl)
        _write(args.out, result)
    if not args.no_timing:
        run_timings(args, kernel_impl, ceiling, t_start, result)
        _write(args.out, result)
    if args.prefill_lens:
        result["prefill"] = run_prefill(args)
    _write(args.out, result)
    print(f"wrote {args.out}")
    if result.get("timings"):
        print(
            f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s (read-only "
            f"{result['read_ceiling_GBps']:.0f}), U = {args.unroll}, {args.steps} iterations"
        )
        print(summary(result["timings"], args.live))
    if result.get("check", {}).get("failures"):
        print(f"{result['check']['failures']} check failures", file=sys.stderr)
    return result


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


if __name__ == "__main__":
    main()
