"""Decode benchmark: ms/token, tokens/s and achieved bandwidth, bf16 vs NVFP4, batch 1 and 8.

Random weights with a real config (default Qwen3-8B; nothing is downloaded), built directly on
the device (NVFP4 weights as random codes and scales, no host quantizer). For each mode and batch
size it times the jitted prefill and the jitted generation loop (`rejax.generate.decode_loop`,
greedy, no early stop) separately, with compilation excluded (the first call is the warm-up) and
the median of repeated runs. Bandwidth = (weight bytes + KV-cache bytes read) per step / step
time, next to a measured device copy ceiling. A breakdown estimates what dominates one decode
step by timing variants in jitted loops: the linears alone (+ lm_head), attention over the cache
alone, the sampler alone (greedy and ReSET), and an empty loop iteration; the remainder (norms,
RoPE, cache writes, launches) is the full step minus their sum.

    PYTHONPATH=. python3 experiments/bench_decode.py --out OUT.json          # H200, Qwen3-8B
    PYTHONPATH=. python3 experiments/bench_decode.py --tiny --out OUT.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import platform
import statistics
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from rejax import config as rconfig
from rejax import layers, sampling
from rejax import params as rparams
from rejax.cache import init_cache
from rejax.ops import _dispatch
from rejax.ops import linear as rlinear
from rejax.params import Params

# The module (the package's `rejax.generate` attribute is the function).
rgen = importlib.import_module("rejax.generate")

TINY = rconfig.Config(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
)


# ----------------------------------------------------------------------------- random weights


def random_params(cfg: rconfig.Config, seed: int = 0) -> Params:
    """Random bf16 or NVFP4 weights built on the device (`rejax.params.random_params`); W4A4
    linears get static, calibrated-style activation scales."""
    params = rparams.random_params(cfg, seed)
    if cfg.quant == "nvfp4":
        scale = jnp.full((cfg.num_layers,), 4.0 / (6 * 448), jnp.float32)
        weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
        params = dataclasses.replace(params, weights=weights)
    return params


def _weight_bytes(params: Params) -> int:
    """Bytes of every weight one decode step reads (embeddings: only B rows, ignored)."""
    total = 0
    for path, leaf in jax.tree_util.tree_flatten_with_path(params.weights)[0]:
        if "embed_tokens" in jax.tree_util.keystr(path) and not params.cfg.tie_word_embeddings:
            continue
        total += leaf.size * leaf.dtype.itemsize
    return int(total)


def _kv_bytes(cfg, batch, slots, itemsize=2) -> int:
    """Bytes of keys + values attention reads per step over `slots` cache slots."""
    return 2 * cfg.num_layers * batch * slots * cfg.num_kv_heads * cfg.head_dim * itemsize


# ----------------------------------------------------------------------------- timing


def _time(fn, repeats: int) -> tuple[float, list[float]]:
    """Median seconds of `repeats` calls after one warm-up call (compilation excluded)."""
    jax.block_until_ready(fn())
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times), times


def copy_ceiling(nbytes: int, repeats: int) -> float:
    """Device read+write bandwidth (bytes/s) of an elementwise pass over `nbytes` bytes."""
    x = jnp.zeros((nbytes // 4,), jnp.uint32)
    f = jax.jit(lambda a: a + jnp.uint32(1))
    t, _ = _time(lambda: f(x), repeats)
    return 2 * x.size * 4 / t


def _run_generation(params, batch, prompt_len, gen_len, repeats, prefill_repeats):
    cfg = params.cfg
    rng = np.random.default_rng(0)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (batch, prompt_len)), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    slots = prompt_len + gen_len
    sampler = sampling.Greedy()
    keys = rgen._row_keys(jax.random.key(0), 0, batch)
    stop = jnp.zeros((cfg.vocab_size,), bool)
    done = jnp.zeros((batch,), bool)
    lengths = jnp.full((batch,), prompt_len, jnp.int32)

    def do_prefill():
        cache = init_cache(cfg, batch, slots, jnp.bfloat16)
        jax.block_until_ready(cache)
        t0 = time.perf_counter()
        out = jax.block_until_ready(rgen.prefill(params, tokens, positions, cache))
        return time.perf_counter() - t0, out

    t0 = time.perf_counter()
    print(f"  prefill b{batch}: compiling", flush=True)
    do_prefill()  # warm-up / compile
    prefill_first_s = time.perf_counter() - t0
    print(f"  prefill b{batch}: compiled + ran in {prefill_first_s:.1f}s", flush=True)
    timed = [do_prefill() for _ in range(max(1, prefill_repeats))]
    t_prefill = statistics.median(t for t, _ in timed)
    logits, cache = timed[-1][1]
    del timed

    def do_decode():
        # A fresh copy each call: the loop donates its cache.
        c = jax.tree_util.tree_map(jnp.copy, cache)
        jax.block_until_ready(c)
        t0 = time.perf_counter()
        out = rgen.decode_loop(
            params,
            logits,
            c,
            lengths,
            sampler,
            sampling.sampler_init(sampler, batch),
            keys,
            stop,
            done,
            max_new_tokens=gen_len,
        )
        jax.block_until_ready(out.tokens)
        return time.perf_counter() - t0, out

    t0 = time.perf_counter()
    print(f"  decode loop b{batch}: compiling", flush=True)
    _, out = do_decode()  # warm-up / compile
    decode_first_s = time.perf_counter() - t0
    print(f"  decode loop b{batch}: compiled + ran in {decode_first_s:.1f}s", flush=True)
    runs = [do_decode()[0] for _ in range(repeats)]
    t_decode = statistics.median(runs)
    n_steps = int(out.step)
    finite = bool(jnp.all(jnp.isfinite(out.entropy)))
    return (
        {
            "prefill_s": t_prefill,
            "prefill_first_call_s": prefill_first_s,  # compile + one run
            "decode_first_call_s": decode_first_s,  # compile + one run
            "decode_s": t_decode,
            "decode_runs_s": runs,
            "steps": n_steps,
            "ms_per_token": 1e3 * t_decode / n_steps,
            "tokens_per_s": batch * n_steps / t_decode,
            "ms_per_token_incl_prefill": 1e3 * (t_decode + t_prefill) / n_steps,
            "entropy_finite": finite,
            "first_tokens_row0": np.asarray(out.tokens[0, :8]).tolist(),
        },
        (logits, cache),
    )


# ----------------------------------------------------------------------------- breakdown


def _loop(body, steps):
    """f(carry, aux): a jitted fori_loop of `steps` dependent iterations of body(carry, aux).

    Arrays the body reads (weights, the cache) come in as the argument `aux`: closed over, they
    would be baked into the executable as constants (gigabytes, and a very slow compile).
    """
    return jax.jit(lambda c, aux: jax.lax.fori_loop(0, steps, lambda i, c: body(c, aux), c))


def _breakdown(params, cache, batch, steps, repeats):
    """Seconds per step of the decode step's parts, each in its own jitted loop."""
    cfg = params.cfg
    d = cfg.hidden_size
    x0 = jnp.ones((batch, d), jnp.bfloat16) * 0.1
    out = {}

    nq, ffw = cfg.num_heads * cfg.head_dim, cfg.intermediate_size

    def linears(x, w):
        at, mlp = w["layers"]["self_attn"], w["layers"]["mlp"]

        def one(i, x):
            qkv = layers.linear(x, at["qkv_proj"], cfg.quant, layer=i)
            o = layers.linear(qkv[:, :nq], at["o_proj"], cfg.quant, layer=i)
            gu = layers.linear(o, mlp["gate_up_proj"], cfg.quant, layer=i)
            h = layers.swiglu(gu[:, :ffw], gu[:, ffw:])
            y = layers.linear(h, mlp["down_proj"], cfg.quant, layer=i)
            return (0.5 * x + 1e-3 * y).astype(x.dtype)

        if isinstance(at["qkv_proj"]["weight"], tuple):  # float: one buffer per layer
            for i in range(cfg.num_layers):
                x = one(i, x)
        else:
            x = jax.lax.fori_loop(0, cfg.num_layers, one, x)
        head = w["embed_tokens"]["embedding"] if cfg.tie_word_embeddings else w["lm_head"]["weight"]
        logits = layers.linear(x, {"weight": head}, None)
        return (x + 1e-6 * logits[:, :d]).astype(x.dtype)

    f = _loop(linears, steps)
    out["linears_and_head"], _ = _time(lambda: f(x0, params.weights), repeats)

    q0 = jnp.ones((batch, 1, cfg.num_heads, cfg.head_dim), jnp.bfloat16) * 0.1
    qpos = jnp.full((batch, 1), cache.positions.shape[1] - 1, jnp.int32)
    mask = layers.attention_mask(qpos, cache.positions.at[:, :].set(0))  # every slot valid

    def attn(q, aux):
        kv, mask = aux

        def one(i, q):
            k, v = layers.take(kv.k, i), layers.take(kv.v, i)
            return (q + 1e-3 * layers.attention(q, k, v, mask)).astype(q.dtype)

        return jax.lax.fori_loop(0, cfg.num_layers, one, q)

    f = _loop(attn, steps)
    out["attention_full_cache"], _ = _time(lambda: f(q0, (cache, mask)), repeats)

    z0 = jax.random.normal(jax.random.key(1), (batch, cfg.vocab_size), jnp.float32)
    nl = jnp.zeros((cfg.vocab_size,), bool).at[10].set(True)
    dnl = jnp.zeros((cfg.vocab_size,), bool).at[11].set(True)
    keys = rgen._row_keys(jax.random.key(0), 0, batch)
    for name, sampler in [
        ("sampling_greedy", sampling.Greedy()),
        ("sampling_reset", sampling.ReSET(nl_mask=nl, dnl_mask=dnl)),
    ]:
        st0 = sampling.sampler_init(sampler, batch)

        def samp(c, aux):
            z, st = c
            ks, smp = aux
            tok, st, _info = sampling.sample(ks, z, st, smp)
            return z + 1e-6 * tok[:, None].astype(z.dtype), st

        f = _loop(samp, steps)
        out[name], _ = _time(
            lambda f=f, st0=st0, sampler=sampler: f((z0, st0), (keys, sampler)), repeats
        )

    f = _loop(lambda c, aux: c + aux, steps)
    out["empty_loop"], _ = _time(lambda: f(jnp.int32(0), jnp.int32(1)), repeats)
    return {k: v / steps for k, v in out.items()}


# ----------------------------------------------------------------------------- main


def _kernel_report(cfg, batches) -> dict:
    on_cuda = jax.default_backend() == "gpu"
    rep = {"on_cuda": on_cuda}
    if not on_cuda:
        rep["note"] = "no CUDA device: NVFP4 linears ran the pure-JAX reference path"
        return rep
    try:
        rep["launch"] = _dispatch.default_launch()
        shapes = {name: rparams.linear_shape(cfg, name) for _, name in rparams.LINEARS}
        rep["supported"] = {
            f"{name}_m{m}": list(rlinear.supported("w4a4", m, n, k))
            for name, (n, k) in shapes.items()
            for m in batches
        }
    except Exception as err:  # noqa: BLE001 - report, do not hide
        rep["error"] = f"{type(err).__name__}: {err}"
    return rep


def _versions() -> dict:
    import flax
    import jaxlib

    out = {
        "python": platform.python_version(),
        "jax": jax.__version__,
        "jaxlib": jaxlib.__version__,
        "flax": flax.__version__,
        "backend": jax.default_backend(),
        "device": str(jax.devices()[0].device_kind),
        "platform_version": str(jax.devices()[0].client.platform_version),
    }
    try:
        from importlib.metadata import version

        out["torch"] = version("torch")
    except Exception:  # noqa: BLE001 - torch is optional
        out["torch"] = None
    try:
        out["git_sha"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip()
    except OSError:
        out["git_sha"] = None
    return out


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--tiny", action="store_true", help="tiny config and lengths (CPU check)")
    ap.add_argument("--layers", type=int, default=None, help="override num_layers (quick checks)")
    ap.add_argument(
        "--modes", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4", "nvfp4-w4a16"]
    )
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--layer-loop", default="auto", choices=["auto", "scan", "unroll"])
    ap.add_argument(
        "--attention", default="einsum", choices=["einsum", "live"], help="Config.attention"
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2, help="timed decode runs (median)")
    ap.add_argument("--prefill-repeats", type=int, default=1)
    ap.add_argument("--breakdown-steps", type=int, default=128)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy-ceiling buffer size")
    ap.add_argument("--out", required=True, help="JSON results path")
    args = ap.parse_args(argv)
    cfg = rconfig.PRESETS[args.preset]
    if args.layers is not None:
        if args.layers <= 0:
            raise SystemExit(f"--layers must be positive, got {args.layers}")
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    cfg = dataclasses.replace(cfg, layer_loop=args.layer_loop, attention=args.attention)
    if args.tiny:
        cfg = TINY
        args.prompt_len, args.gen_len = min(args.prompt_len, 32), min(args.gen_len, 16)
        args.breakdown_steps, args.copy_mib = min(args.breakdown_steps, 8), min(args.copy_mib, 16)
    t_start = time.perf_counter()
    result = {
        "config": dataclasses.asdict(cfg),
        "args": vars(args),
        "versions": _versions(),
        "kernel": _kernel_report(cfg, args.batch),
        "runs": [],
    }
    result["breakdown_note"] = (
        "each part runs alone in a jitted fori_loop with loop-invariant weights; XLA may hoist "
        "weight-only work out of such loops (the pure-JAX NVFP4 reference unpacks weights, the "
        "CUDA kernel reads packed weights directly), so on the reference path (no GPU) the "
        "linears time is a lower bound and the remainder absorbs the difference"
    )
    result["copy_ceiling_GBps"] = copy_ceiling(args.copy_mib << 20, args.repeats) / 1e9
    print(f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s", flush=True)
    bucket = rgen._bucket(args.prompt_len)
    for mode in args.modes:
        quant = None if mode == "bf16" else mode
        t0 = time.perf_counter()
        params = random_params(dataclasses.replace(cfg, quant=quant))
        jax.block_until_ready(params.weights)
        wbytes = _weight_bytes(params)
        print(
            f"[{mode}] weights {wbytes / 1e9:.2f} GB built in {time.perf_counter() - t0:.1f}s",
            flush=True,
        )
        for batch in args.batch:
            t0 = time.perf_counter()
            try:
                run, (_, cache) = _run_generation(
                    params, batch, bucket, args.gen_len, args.repeats, args.prefill_repeats
                )
            except Exception as err:  # noqa: BLE001 - record the failure, keep benchmarking
                result["runs"].append(
                    {"mode": mode, "batch": batch, "error": f"{type(err).__name__}: {err}"}
                )
                print(f"[{mode} b{batch}] FAILED {err}", flush=True)
                continue
            slots = bucket + args.gen_len
            kv_full = _kv_bytes(cfg, batch, slots)
            kv_live = _kv_bytes(cfg, batch, bucket + args.gen_len / 2)  # mean valid slots
            step_s = run["ms_per_token"] / 1e3
            run.update(
                mode=mode,
                batch=batch,
                prompt_len=bucket,
                gen_len=args.gen_len,
                weight_bytes=wbytes,
                kv_bytes_read_per_step=kv_full,
                kv_bytes_valid_mean=kv_live,
                bandwidth_GBps=(wbytes + kv_full) / step_s / 1e9,
                weight_bandwidth_GBps=wbytes / step_s / 1e9,
            )
            run["fraction_of_copy_ceiling"] = run["bandwidth_GBps"] / result["copy_ceiling_GBps"]
            if not args.no_breakdown:
                bd = _breakdown(params, cache, batch, args.breakdown_steps, args.repeats)
                parts = (
                    bd["linears_and_head"]
                    + bd["attention_full_cache"]
                    + bd["sampling_greedy"]
                    + bd["empty_loop"]
                )
                bd["remainder_norms_rope_cache_launch"] = step_s - parts
                run["breakdown_ms_per_step"] = {k: 1e3 * v for k, v in bd.items()}
                run["dominant"] = max(
                    (
                        "linears_and_head",
                        "attention_full_cache",
                        "sampling_greedy",
                        "remainder_norms_rope_cache_launch",
                    ),
                    key=lambda k: bd[k],
                )
            del cache
            run["wall_s"] = time.perf_counter() - t0
            result["runs"].append(run)
            _write(args.out, result)  # partial results survive a timeout
            print(
                f"[{mode} b{batch}] {run['ms_per_token']:.3f} ms/token, "
                f"{run['tokens_per_s']:.1f} tok/s, {run['bandwidth_GBps']:.0f} GB/s, "
                f"prefill {run['prefill_s'] * 1e3:.1f} ms"
                + (f", dominant: {run.get('dominant')}" if "dominant" in run else ""),
                flush=True,
            )
        del params
    speed = {}
    for batch in args.batch:
        by = {r["mode"]: r for r in result["runs"] if r["batch"] == batch and "error" not in r}
        if "bf16" in by and "nvfp4" in by:
            speed[f"b{batch}"] = by["bf16"]["ms_per_token"] / by["nvfp4"]["ms_per_token"]
    result["nvfp4_speedup_over_bf16"] = speed
    result["total_wall_s"] = time.perf_counter() - t_start
    _write(args.out, result)
    print(f"wrote {args.out} ({result['total_wall_s']:.0f}s)", flush=True)
    return result


if __name__ == "__main__":
    main(sys.argv[1:])
