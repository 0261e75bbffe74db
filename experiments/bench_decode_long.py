"""Long-output decode benchmark: the acceptance numbers of decode attention over live slots.

On one GPU (default: Qwen3-8B, 36 layers, random weights; nothing is downloaded) it measures

(a) the decode-step time with a cache sized for the longest output (prompt + 32,768 slots)
    against one sized for the shortest (prompt + 1,024 = 1,536 slots), at the same live length
    of 1K, batch 1 and 8, NVFP4 W4A4, `Config.attention` "live" and "einsum";
(b) attention alone (`rejax.ops.decode_attention` over all layers of the real cache, one jitted
    loop of dependent calls) at live lengths 8K and 32K, bf16 and fp8 KV: the live K/V bytes
    read, GB/s, and the fraction of a copy ceiling measured in the same run
    (`rejax.bench.copy_ceiling`, a device-to-device elementwise pass: read + write bytes / s);
(c) the paper's table: NVFP4 speedup over bf16 weights by output length 1K .. 32K at batch 1
    and 8 (prompt 512, greedy, no early stop), with NVFP4 rows for a bf16 and an fp8 KV cache.

A 32K-token generation of the 36-layer model takes minutes, so (c) is not timed end to end: the
cache is set to a live length directly (slot positions and the write index are written, the K/V
contents are whatever the cache holds; timing does not depend on them), a short jitted decode
loop (`rejax.decode.decode_loop`, the product's loop: greedy sampling + one forward per step)
times `--steps` steps from there, and the per-step time, a function of the live length, is
summed over every step of each output length (linear interpolation between the measured live
lengths). The prompt's prefill is not included (tens of ms against seconds of decoding).
The live length is a device value (the cache index), so each (weights, KV dtype, attention,
batch, cache size) compiles once and serves every live length; compile + first-run seconds are
recorded. `--full-32k` also runs one real 32,768-token NVFP4 generation at batch 1 (prefill +
decode loop, a few minutes) and checks that every entropy is finite.

    PYTHONPATH=. python experiments/bench_decode_long.py           # H200, about 4 minutes
    PYTHONPATH=. python experiments/bench_decode_long.py --quick   # batch 1, fewer points
    PYTHONPATH=. python experiments/bench_decode_long.py --tiny --out /tmp/long.json  # CPU

Writes experiments/results/bench_decode_long_h200.json by default.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode  # random weights with static W4A4 scales, the tiny config

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import sampling
from rejax.cache import init_cache
from rejax.decode import decode_loop, prefill
from rejax.ops.decode_attention import decode_attention

DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_decode_long_h200.json"
# (quant, kv_dtype) of the table's rows; bf16 weights with a bf16 cache is the baseline.
MODELS = (("bf16", "bf16"), ("nvfp4", "bf16"), ("nvfp4", "fp8"))


# ----------------------------------------------------------------------------- the cache


def set_live(cache, index: int):
    """The cache with slots [0, index) holding positions 0 .. index-1 and the write index at
    `index` (same buffers and shapes: a compiled step is reused for any index)."""
    s = cache.length
    slots = jnp.arange(s, dtype=jnp.int32)
    positions = jnp.where(slots < index, slots, -1)[None].repeat(cache.batch_size, 0)
    return dataclasses.replace(cache, positions=positions, index=jnp.asarray(index, jnp.int32))


def kv_bytes_read(cfg, batch: int, live: float) -> float:
    """K/V bytes attention reads per step over all layers at `live` slots (fp8: codes + scales)."""
    per_slot = 2 * cfg.num_layers * batch * cfg.num_kv_heads
    if cfg.kv_dtype == "fp8":
        return per_slot * live * (cfg.head_dim + 4)
    return per_slot * live * cfg.head_dim * 2


# ----------------------------------------------------------------------------- step timing


class StepTimer:
    """Times `steps` decode steps from chosen live lengths with one compiled decode loop.

    The cache is donated to every call and the returned one is kept, so no copy is made and
    only one cache is alive.
    """

    def __init__(self, params, batch: int, slots: int, steps: int, repeats: int, cache=None):
        self.params, self.batch, self.steps, self.repeats = params, batch, steps, repeats
        cfg = params.cfg
        self.cache = init_cache(cfg, batch, slots) if cache is None else cache
        self.sampler = sampling.Greedy()
        self.logits = jnp.zeros((batch, cfg.vocab_size), jnp.float32)
        self.keys = jax.random.split(jax.random.key(0), batch)
        self.never = jnp.zeros((cfg.vocab_size,), bool)  # no stop token: exactly `steps` steps
        self.done = jnp.zeros((batch,), bool)
        self.first_call_s = None

    def _call(self, index: int) -> float:
        cache = set_live(self.cache, index)
        pos = jnp.full((self.batch,), index, jnp.int32)
        state = sampling.sampler_init(self.sampler, self.batch)
        jax.block_until_ready((cache, pos, state))
        t0 = time.perf_counter()
        out = decode_loop(
            self.params,
            self.logits,
            cache,
            pos,
            self.sampler,
            state,
            self.keys,
            self.never,
            self.done,
            max_new_tokens=self.steps,
        )
        jax.block_until_ready(out.tokens)
        dt = time.perf_counter() - t0
        assert int(out.step) == self.steps
        self.cache = out.cache
        return dt

    def ms_per_step(self, index: int) -> float:
        """Median ms per step of `repeats` loops starting at `index` (after a warm-up call)."""
        if index + self.steps > self.cache.length:
            raise ValueError(f"{index=} + steps={self.steps} exceeds {self.cache.length} slots")
        t = self._call(index)
        if self.first_call_s is None:
            self.first_call_s = t  # compile + one run
        return 1e3 * statistics.median(self._call(index) for _ in range(self.repeats)) / self.steps


# ----------------------------------------------------------------------------- attention alone


def _attention_loop(num_layers: int, steps: int):
    """Jitted: `steps` dependent rounds of decode attention over every layer (layer traced); a
    layer's output is the next layer's query, so the loop holds no other op per call."""

    def run(q0, cache, q_positions, live):
        def one_round(_, q):
            def layer(x, i):
                y = decode_attention(
                    x, cache.k, cache.v, i, q_positions, cache.positions, live,
                    k_scale=cache.k_scale, v_scale=cache.v_scale,
                )  # fmt: skip
                return y.astype(x.dtype), None

            return jax.lax.scan(layer, q, jnp.arange(num_layers, dtype=jnp.int32))[0]

        return jax.lax.fori_loop(0, steps, one_round, q0)

    return jax.jit(run)


def attention_alone(cfg, cache, lives, steps: int, repeats: int, ceiling: float) -> list[dict]:
    """Per-layer decode-attention time at each live length over the real cache."""
    b = cache.batch_size
    f = _attention_loop(cfg.num_layers, steps)
    q0 = jnp.full((b, cfg.num_heads, cfg.head_dim), 0.1, jnp.bfloat16)
    rows = []
    for live in lives:
        c = set_live(cache, live)
        qpos = jnp.full((b,), live - 1, jnp.int32)
        args = (q0, c, qpos, jnp.int32(live))
        t0 = time.perf_counter()
        jax.block_until_ready(f(*args))
        first = time.perf_counter() - t0
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            times.append(time.perf_counter() - t0)
        per_layer = statistics.median(times) / (steps * cfg.num_layers)
        nbytes = kv_bytes_read(cfg, b, live) / cfg.num_layers
        rows.append(
            {
                "kv_dtype": cfg.kv_dtype,
                "batch": b,
                "live": live,
                "us_per_layer": 1e6 * per_layer,
                "kv_bytes_per_layer": nbytes,
                "GBps": nbytes / per_layer / 1e9,
                "fraction_of_copy": nbytes / per_layer / 1e9 / ceiling,
                "first_call_s": first,
            }
        )
    return rows


# ----------------------------------------------------------------------------- the table


def total_decode_s(curve: list[dict], prompt_len: int, out_len: int) -> float:
    """Seconds to decode `out_len` tokens after `prompt_len`: the per-step time, interpolated
    linearly in the live length between the measured points (constant past the ends), summed
    over every step (step t reads prompt_len + t + 1 slots)."""
    lives = np.asarray([p["mean_live"] for p in curve], np.float64)
    ms = np.asarray([p["ms_per_step"] for p in curve], np.float64)
    order = np.argsort(lives)
    steps = prompt_len + 1 + np.arange(out_len, dtype=np.float64)
    return float(np.interp(steps, lives[order], ms[order]).sum() / 1e3)


def speedup_table(curves: dict, prompt_len: int, outputs, batches) -> list[dict]:
    rows = []
    for b in batches:
        base = curves.get(("bf16", "bf16", b))
        for out_len in outputs:
            row = {"batch": b, "output_len": out_len}
            for quant, kv in MODELS:
                c = curves.get((quant, kv, b))
                if c:
                    row[f"{quant}_{kv}kv_s"] = total_decode_s(c, prompt_len, out_len)
            for kv in ("bf16", "fp8"):
                key = f"nvfp4_{kv}kv_s"
                if base and key in row:
                    row[f"speedup_nvfp4_{kv}kv"] = row["bf16_bf16kv_s"] / row[key]
            rows.append(row)
    return rows


# ----------------------------------------------------------------------------- main


def _plan(args):
    """Shapes of this run: prompt, outputs, short/long cache sizes, curve and attention lives."""
    p, outputs = args.prompt_len, sorted(args.outputs)
    long_s, short_s = p + outputs[-1], p + outputs[0]
    live_a = outputs[0]  # the "same live length" of (a): the short output's length (1K)
    half = args.steps // 2
    curve = sorted({p, live_a - half, *(min(p + o, long_s - args.steps) for o in outputs)})
    return {
        "prompt_len": p,
        "outputs": outputs,
        "long_slots": long_s,
        "short_slots": short_s,
        "cache_size_index": live_a - half,
        "curve_indices": curve,
        "attention_lives": [min(x, long_s) for x in args.attn_lives],
    }


def _log(msg: str) -> None:
    print(msg, flush=True)


def run(args) -> dict:
    t_start = time.perf_counter()
    if args.tiny:
        base = bench_decode.TINY
    else:
        base = rconfig.PRESETS[args.preset]
        if args.layers is not None:
            base = dataclasses.replace(base, num_layers=args.layers)
    plan = _plan(args)
    steps, repeats = args.steps, args.repeats
    result = {
        "config": dataclasses.asdict(base),
        "args": {k: v for k, v in vars(args).items() if k != "out"},
        "plan": plan,
        "versions": rbench.versions(),
        "method": (
            "decode-step times at set live lengths (cache positions and index written directly, "
            f"no 32K-step runs): median of {repeats} jitted decode_loop calls of {steps} greedy "
            "steps after a warm-up, mean live = index + (steps + 1) / 2; the table sums the "
            "per-step time, linearly interpolated in the live length, over every step of each "
            "output length (prompt prefill excluded). One compile per (weights, kv_dtype, "
            "attention, batch, cache size); first_call_s = compile + one run."
        ),
    }
    ceiling = rbench.copy_ceiling(args.copy_mib << 20, repeats=max(3, repeats)) / 1e9
    result["copy_ceiling_GBps"] = ceiling
    _log(f"copy ceiling {ceiling:.0f} GB/s ({args.copy_mib} MiB, read + write)")
    steps_rows, attn_rows, curves = [], [], {}
    if args.attention_only:
        result["attention_alone"] = attention_only(base, plan, args, ceiling)
        result["total_wall_s"] = time.perf_counter() - t_start
        return result

    def timed(params, batch, slots, indices, what, cache=None):
        t0 = time.perf_counter()
        timer = StepTimer(params, batch, slots, steps, repeats, cache)
        pts = []
        for i in indices:
            ms = timer.ms_per_step(i)
            pts.append({"index": i, "mean_live": i + (steps + 1) / 2, "ms_per_step": ms})
        what = {**what, "attention": params.cfg.attention}
        row = {**what, "batch": batch, "slots": slots, "first_call_s": timer.first_call_s,
               "wall_s": time.perf_counter() - t0, "points": pts}  # fmt: skip
        steps_rows.append(row)
        _log(
            f"[{what['quant']} {what['kv_dtype']}-kv {what['attention']} b{batch} S={slots}] "
            + ", ".join(f"live {p['mean_live']:.0f}: {p['ms_per_step']:.3f} ms" for p in pts)
            + f" (first call {timer.first_call_s:.1f} s, wall {row['wall_s']:.1f} s)"
        )
        return timer, pts

    for quant, kv in MODELS:
        if kv == "fp8" and args.no_fp8:
            continue
        cfg = dataclasses.replace(base, quant=rbench.QUANTS[quant], kv_dtype=kv, attention="live")
        t0 = time.perf_counter()
        params = bench_decode.random_params(cfg)
        jax.block_until_ready(params.weights)
        wbytes = rbench.weight_bytes(params)
        _log(f"[{quant} {kv}-kv] weights {wbytes / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s")
        ein = dataclasses.replace(params, cfg=dataclasses.replace(cfg, attention="einsum"))
        what = {"quant": quant, "kv_dtype": kv, "weight_bytes": wbytes}
        for b in args.batch:
            idx = sorted({*plan["curve_indices"], plan["cache_size_index"]})
            timer, curves[(quant, kv, b)] = timed(params, b, plan["long_slots"], idx, what)
            if quant == "nvfp4":  # (b): attention alone over the same cache
                rows = attention_alone(
                    cfg, timer.cache, plan["attention_lives"], steps, repeats, ceiling
                )
                attn_rows += rows
                for r in rows:
                    _log(
                        f"  attention {kv}-kv b{b} live {r['live']}: {r['us_per_layer']:.1f} us "
                        f"per layer, {r['GBps']:.0f} GB/s = {100 * r['fraction_of_copy']:.0f}% "
                        "of copy"
                    )
            if quant == "nvfp4" and kv == "bf16":  # (a): cache sizes, live vs einsum
                ix = [plan["cache_size_index"]]
                if not args.no_einsum:  # the long cache's buffers again
                    timer, _ = timed(ein, b, plan["long_slots"], ix, what, timer.cache)
                del timer
                timer, _ = timed(params, b, plan["short_slots"], ix, what)
                if not args.no_einsum:
                    timed(ein, b, plan["short_slots"], ix, what, timer.cache)
            del timer
        del params, ein
    result["steps"] = steps_rows
    result["attention_alone"] = attn_rows
    result["table"] = speedup_table(curves, plan["prompt_len"], plan["outputs"], args.batch)
    result["acceptance"] = acceptance(steps_rows, attn_rows, plan)
    if args.full_32k:
        result["full_generation"] = full_generation(base, plan, args.full_new_tokens)
    result["total_wall_s"] = time.perf_counter() - t_start
    return result


def attention_only(base, plan, args, ceiling: float) -> list[dict]:
    """(b) alone: attention over a cache of the long size, per KV dtype and batch."""
    rows = []
    for kv in ("bf16",) if args.no_fp8 else ("bf16", "fp8"):
        cfg = dataclasses.replace(base, quant=rbench.QUANTS["nvfp4"], kv_dtype=kv, attention="live")
        for b in args.batch:
            cache = init_cache(cfg, b, plan["long_slots"])
            got = attention_alone(
                cfg, cache, plan["attention_lives"], args.steps, args.repeats, ceiling
            )
            for r in got:
                _log(
                    f"  attention {kv}-kv b{b} live {r['live']}: {r['us_per_layer']:.1f} us "
                    f"per layer, {r['GBps']:.0f} GB/s = {100 * r['fraction_of_copy']:.0f}% of copy"
                )
            rows += got
            del cache
    return rows


def _ms_at(steps_rows, attention: str, batch: int, slots: int, index: int) -> float | None:
    for r in steps_rows:
        key = (r["quant"], r["kv_dtype"], r["attention"], r["batch"], r["slots"])
        if key == ("nvfp4", "bf16", attention, batch, slots):
            for p in r["points"]:
                if p["index"] == index:
                    return p["ms_per_step"]
    return None


def acceptance(steps_rows, attn_rows, plan) -> dict:
    """The issue's two numeric criteria from this run's rows: the long / short cache step-time
    ratio at live 1K (<= 1.10 with live attention) and attention's share of the copy ceiling
    at live 8K and 32K (>= 0.70)."""
    out = {}
    ix = plan["cache_size_index"]
    for attention in ("live", "einsum"):
        for b in sorted({r["batch"] for r in steps_rows}):
            long_ms = _ms_at(steps_rows, attention, b, plan["long_slots"], ix)
            short_ms = _ms_at(steps_rows, attention, b, plan["short_slots"], ix)
            if long_ms and short_ms:
                ratio = long_ms / short_ms
                out[f"cache_size_ratio_{attention}_b{b}"] = ratio
                if attention == "live":
                    out[f"cache_size_ratio_ok_b{b}"] = ratio <= 1.10
    for r in attn_rows:
        key = f"attention_fraction_of_copy_{r['kv_dtype']}kv_b{r['batch']}_live{r['live']}"
        out[key] = r["fraction_of_copy"]
    out["attention_fraction_ok"] = bool(attn_rows) and all(
        r["fraction_of_copy"] >= 0.70 for r in attn_rows
    )
    return out


def full_generation(base, plan, new_tokens: int) -> dict:
    """One real generation: prefill a random prompt, decode `new_tokens` greedy steps (no stop)
    with the NVFP4 model and live attention at batch 1; entropies must all be finite."""
    cfg = dataclasses.replace(base, quant="nvfp4", attention="live")
    params = bench_decode.random_params(cfg)
    p = plan["prompt_len"]
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, p)), jnp.int32)
    pos = jnp.arange(p, dtype=jnp.int32)[None]
    t0 = time.perf_counter()
    logits, cache = prefill(params, tokens, pos, init_cache(cfg, 1, p + new_tokens))
    sampler = sampling.Greedy()
    out = decode_loop(
        params, logits, cache, jnp.full((1,), p, jnp.int32), sampler,
        sampling.sampler_init(sampler, 1), jax.random.split(jax.random.key(0), 1),
        jnp.zeros((cfg.vocab_size,), bool), jnp.zeros((1,), bool), max_new_tokens=new_tokens,
    )  # fmt: skip
    ent = np.asarray(out.entropy[0])
    wall = time.perf_counter() - t0
    res = {
        "new_tokens": int(out.step),
        "prompt_len": p,
        "wall_s_incl_compile": wall,
        "entropy_finite": bool(np.isfinite(ent).all()),
        "entropy_min": float(np.nanmin(ent)),
        "entropy_max": float(np.nanmax(ent)),
        "entropy_mean": float(np.nanmean(ent)),
    }
    _log(f"full generation: {res}")
    return res


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override num_layers")
    ap.add_argument("--tiny", action="store_true", help="tiny config and lengths (CPU check)")
    ap.add_argument("--quick", action="store_true", help="batch 1, fewer outputs and repeats")
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument(
        "--outputs", nargs="+", type=int, default=[1024, 2048, 4096, 8192, 16384, 32768]
    )
    ap.add_argument("--attn-lives", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--steps", type=int, default=16, help="decode steps per timed loop")
    ap.add_argument("--repeats", type=int, default=3, help="timed loops per point (median)")
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy-ceiling buffer size")
    ap.add_argument("--no-einsum", action="store_true", help="skip the einsum comparison")
    ap.add_argument("--no-fp8", action="store_true", help="skip the fp8-KV rows")
    ap.add_argument(
        "--attention-only",
        action="store_true",
        help="only (b), attention alone over a cache of the long size (no decode loops, no "
        "table, no acceptance)",
    )
    ap.add_argument(
        "--full-32k", action="store_true", help="also one real NVFP4 generation, batch 1"
    )
    ap.add_argument("--full-new-tokens", type=int, default=32768)
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    args = ap.parse_args(argv)
    if args.layers is not None and args.layers <= 0:
        raise SystemExit(f"--layers must be positive, got {args.layers}")
    if args.quick:
        args.batch, args.outputs = [1], [1024, 4096, 32768]
        args.repeats, args.steps = min(args.repeats, 2), min(args.steps, 8)
    if args.tiny:
        args.prompt_len, args.outputs = 32, [16, 32, 64]
        args.attn_lives, args.steps, args.repeats = [24, 64], 4, 1
        args.copy_mib, args.full_new_tokens = 16, min(args.full_new_tokens, 32)
        args.batch = args.batch[:1] if args.quick else [1, 2]
    if min(args.outputs) <= args.steps // 2 or args.steps <= 0 or args.repeats <= 0:
        raise SystemExit(
            f"need steps > 0, repeats > 0 and outputs > steps / 2, got {args.steps=} "
            f"{args.repeats=} {args.outputs=}"
        )
    result = run(args)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2, default=str))
    if args.attention_only:
        _log(f"wrote {out} ({result['total_wall_s']:.0f} s)")
        return result
    for r in result["table"]:
        _log(
            f"b{r['batch']} {r['output_len']:>6} tokens: "
            + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if k not in ("batch", "output_len"))
        )
    _log(f"acceptance: {result['acceptance']}")
    _log(f"wrote {out} ({result['total_wall_s']:.0f} s)")
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
