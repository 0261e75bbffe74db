"""Decode benchmark: ms/token, tokens/s and achieved bandwidth, bf16 vs NVFP4, batch 1 and 8.

A thin user of `rejax bench` (rejax/bench.py) for the experiments' device scripts: random
weights with a real config (default Qwen3-8B; nothing is downloaded) built on the device
(`rejax.params.random_params`, with static W4A4 activation scales), the product's timing of the
jitted prefill and decode loop (`rejax.bench.bench_decode`: greedy, no early stop, first call
recorded, median of repeated runs), the product's copy ceiling and versions, plus what the
command line does not offer: `--layer-loop` / `--attention` (Config fields; several
`--attention` values run every variant once per value) and a breakdown. Bandwidth = (weight
bytes + KV-cache bytes read) per step / step time, next to a measured device copy ceiling. A
breakdown estimates what dominates one decode step by timing variants in jitted loops: the
linears alone (+ lm_head), attention over the cache alone, the sampler alone (greedy and ReSET),
and an empty loop iteration; the remainder (norms, RoPE, cache writes, launches) is the full
step minus their sum.

    PYTHONPATH=. python3 experiments/bench_decode.py --out OUT.json          # H200, Qwen3-8B
    PYTHONPATH=. python3 experiments/bench_decode.py --tiny --out OUT.json   # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import statistics
import sys
import time

import jax
import jax.numpy as jnp

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import layers, sampling
from rejax import params as rparams
from rejax.cache import init_cache
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch
from rejax.ops import linear as rlinear
from rejax.ops import sampler as sampler_op
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


# Config fields with a fixed set of values that a run may switch (one flag each)
CHOICE_FIELDS = {
    "rope_fusion": rconfig.ROPE_FUSIONS,
    "residual_fusion": rconfig.RESIDUAL_FUSIONS,
    "gemm_reduce": rconfig.GEMM_REDUCES,
    "gemm_copies": rconfig.GEMM_COPIES,
    "gemm_x_quant": rconfig.GEMM_X_QUANTS,
    "gemm_wgmma_x_quant": rconfig.GEMM_WGMMA_X_QUANTS,
    "gemm_dot_x": rconfig.GEMM_DOT_XS,
    "gemm_wgmma_tm": rconfig.GEMM_WGMMA_TMS,
}


# Config fields that take several values, one variant each (`_variants`), and what they vary
MULTI_FIELDS = (
    ("attention", rconfig.ATTENTIONS, "every variant (labelled ' attn=CHOICE')"),
    ("command_buffer", rconfig.COMMAND_BUFFERS, "every variant (labelled ' cb=CHOICE')"),
    ("gemm_occupancy", rconfig.GEMM_OCCUPANCIES, "every NVFP4 variant (labelled ' occ=CHOICE')"),
    ("linear_fusion", rconfig.LINEAR_FUSIONS, "every NVFP4 variant (labelled ' lf=CHOICE')"),
    ("attention_output", rconfig.ATTENTION_OUTPUTS, "every NVFP4 variant (labelled ' ao=CHOICE')"),
    ("gate_up_output", rconfig.GATE_UP_OUTPUTS, "every NVFP4 variant (labelled ' go=CHOICE')"),
    ("o_proj_output", rconfig.O_PROJ_OUTPUTS, "every NVFP4 variant (labelled ' oo=CHOICE')"),
    ("gemm_chain", rconfig.GEMM_CHAINS, "every NVFP4 variant (labelled ' gc=CHOICE')"),
    ("gemm_dot_finish", rconfig.GEMM_DOT_FINISHES, "every NVFP4 variant (labelled ' df=CHOICE')"),
    ("gemm_dot_stream", rconfig.GEMM_DOT_STREAMS, "every NVFP4 variant (labelled ' ds=CHOICE')"),
)


# The loop's int Config fields that take several values: (field, label tag, what it sets)
LOOP_FIELDS = (
    ("scan_unroll", "su", "layer bodies per iteration of the NVFP4 layer scan"),
    ("decode_unroll", "du", "decode steps per check of the decode loop's predicate"),
)


def random_params(cfg: rconfig.Config, seed: int = 0) -> Params:
    """Random bf16 or NVFP4 weights built on the device (`rejax.params.random_params`); W4A4
    linears get static, calibrated-style activation scales."""
    params = rparams.random_params(cfg, seed)
    if cfg.quant == "nvfp4":
        scale = jnp.full((cfg.num_layers,), 4.0 / (6 * 448), jnp.float32)
        weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
        params = dataclasses.replace(params, weights=weights)
    return params


def _quantized(w) -> bool:
    return isinstance(w, Nvfp4Tensor)


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


SAMPLERS = {
    "greedy": lambda: sampling.Greedy(),
    "reset": lambda: sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95),
    "reset-topk": lambda: sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95, top_p_method="topk"),
    "temp": lambda: sampling.Temperature(t=0.6, top_p=0.95),
    "temp-topk": lambda: sampling.Temperature(t=0.6, top_p=0.95, top_p_method="topk"),
    "topk20": lambda: sampling.Temperature(t=0.6, top_p=0.95, top_k=20),
    # the fused sampler's CUDA kernels by variant (`rejax.ops.sampler.VARIANTS`, and
    # STATE_VARIANTS: "grid-state" / "cdf-state", ReSET's state update in the kernel)
    **{
        f"{name}-{v}": (
            lambda make=make, v=v: dataclasses.replace(make(), top_p_method=f"kernel-{v}")
        )
        for name, make in [
            ("reset", lambda: sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95)),
            ("temp", lambda: sampling.Temperature(t=0.6, top_p=0.95)),
            ("topk20", lambda: sampling.Temperature(t=0.6, top_p=0.95, top_k=20)),
        ]
        for v in (*sampler_op.VARIANTS, *sampler_op.STATE_VARIANTS)
    },
}


def _run_generation(params, batch, prompt_len, gen_len, repeats, sampler="greedy",
                    logits_dtype=None):  # fmt: skip
    """`rejax.bench.bench_decode` (the product's timing of prefill and the decode loop), plus a
    cache filled by one more prefill for the breakdown below."""
    run = rbench.bench_decode(
        params,
        batch=batch,
        new_tokens=gen_len,
        prompt_len=prompt_len,
        repeats=repeats,
        sampler=SAMPLERS[sampler](),
        logits_dtype=logits_dtype,
    )
    cfg = params.cfg
    tokens = jnp.zeros((batch, prompt_len), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(prompt_len, dtype=jnp.int32), (batch, prompt_len))
    cache = init_cache(cfg, batch, prompt_len + gen_len, jnp.bfloat16)
    _, cache = rgen.prefill(params, tokens, positions, cache)
    return run, cache


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
        logits = layers.linear(x, {"weight": head}, "nvfp4-w4a16" if _quantized(head) else None)
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


def over_greedy(runs: list[dict]) -> dict[str, list[float]]:
    """Each non-greedy run's us per token over greedy, against the greedy runs beside it.

    Runs are grouped by (mode, variant, batch, logits dtype) in the order they ran; a run's
    baseline is the mean of the nearest greedy run before it and the nearest after it (one of
    them at an end), so a drift of the card during the process cancels when --samplers
    alternates greedy with the others (`--samplers greedy temp greedy reset greedy`). Sets
    run["over_greedy_us"] and returns {"VARIANT bB DTYPE SAMPLER": [us, ...]}; a group without
    a greedy run is left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in runs:
        if "error" not in r:
            key = (r["mode"], r["variant"], r["batch"], r.get("logits_dtype"))
            groups.setdefault(key, []).append(r)
    out: dict[str, list[float]] = {}
    for (_, variant, batch, dtype), rs in groups.items():
        greedy = [i for i, r in enumerate(rs) if r["sampler"] == "greedy"]
        for i, r in enumerate(rs):
            if r["sampler"] == "greedy" or not greedy:
                continue
            before = [rs[j]["ms_per_token"] for j in greedy if j < i][-1:]
            after = [rs[j]["ms_per_token"] for j in greedy if j > i][:1]
            base = statistics.mean(before + after)
            r["over_greedy_us"] = 1e3 * (r["ms_per_token"] - base)
            out.setdefault(f"{variant} b{batch} {dtype} {r['sampler']}", []).append(
                r["over_greedy_us"]
            )
    return out


def _write(path: str, result: dict) -> None:
    with open(path, "w") as f:
        json.dump(result, f, indent=2, default=str)


def _max_m(text: str) -> int | None:
    if text.lower() == "none":
        return None
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an int or 'none', got {text!r}") from None


def _raster(text: str) -> int:
    """An int >= 0 (Config.gemm_wgmma_raster)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected an int >= 0, got {text!r}")
    return value


def _wgmma_rows(text: str) -> int | None | str:
    """An int, 'none' or 'default' (Config.gemm_wgmma_min_m / max_m)."""
    if text.lower() == "default":
        return "default"
    try:
        return _max_m(text)
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(
            f"expected an int, 'none' or 'default', got {text!r}"
        ) from None


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive int, got {value}")
    return value


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
    for field, choices in CHOICE_FIELDS.items():  # the decode-kernel choices of Config
        ap.add_argument(
            "--" + field.replace("_", "-"),
            default=getattr(rconfig.Config, field),
            choices=list(choices),
            help=f"Config.{field}",
        )
    for field, choices, what in MULTI_FIELDS:  # several values: one variant per value
        ap.add_argument(
            "--" + field.replace("_", "-"),
            nargs="+",
            default=[getattr(rconfig.Config, field)],
            choices=list(choices),
            help=f"Config.{field}: several values run {what} once per value, in the same "
            "process, on the same weights",
        )
    for field, tag, what in LOOP_FIELDS:  # several values: every variant once per value
        ap.add_argument(
            "--" + field.replace("_", "-"),
            nargs="+",
            type=_positive,
            default=[getattr(rconfig.Config, field)],
            help=f"Config.{field}: {what}; several values run every variant once per value "
            f"(labelled ' {tag}=K' unless Config's default)",
        )
    ap.add_argument(
        "--gemm-min-m",
        type=int,
        default=rconfig.Config.gemm_min_m,
        help="Config.gemm_min_m: NVFP4 W4A4 linears with this many rows or more take the GEMM",
    )
    ap.add_argument(
        "--gemm-max-m",
        type=_max_m,
        default=rconfig.Config.gemm_max_m,
        help="Config.gemm_max_m: ... and at most this many ('none': no bound); more (prefill) "
        "take the dot reference",
    )
    ap.add_argument(
        "--gemm-wgmma-min-m",
        type=_wgmma_rows,
        nargs="+",
        default=[rconfig.Config.gemm_wgmma_min_m],
        help="Config.gemm_wgmma_min_m: NVFP4 W4A4 linears with this many rows or more (prefill, "
        "decode batches of 128+) take the wgmma GEMM ('default': 128, 'none': never); several "
        "values run every NVFP4 variant once per value (labelled ' wg=K' unless 'default')",
    )
    ap.add_argument(
        "--gemm-wgmma-max-m",
        type=_wgmma_rows,
        nargs="+",
        default=[rconfig.Config.gemm_wgmma_max_m],
        help="Config.gemm_wgmma_max_m: ... and at most this many ('default': 2048, 'none': no "
        "bound: the batch-8 prefill's 4096 rows take the wgmma GEMM, not the dot path); several "
        "values run every NVFP4 variant once per value (labelled ' wgmax=K' unless 'default')",
    )
    ap.add_argument(
        "--gemm-wgmma-raster",
        type=_raster,
        nargs="+",
        default=[rconfig.Config.gemm_wgmma_raster],
        help="Config.gemm_wgmma_raster: the order of the wgmma GEMM's tiles (0: the grid's; G: "
        "groups of G token tiles); several values run every NVFP4 variant once per value "
        "(labelled ' ras=G' unless 0)",
    )
    ap.add_argument(
        "--gemm-dot-dequant",
        nargs="+",
        default=[rconfig.Config.gemm_dot_dequant],
        choices=list(rconfig.GEMM_DOT_DEQUANTS),
        help="Config.gemm_dot_dequant: how the dot path (prefill, above --gemm-max-m rows) "
        "decodes the weights, XLA's fusions or the dequantizer kernel; several values run "
        "every NVFP4 variant once per value (labelled ' dq=CHOICE' unless the default)",
    )
    ap.add_argument(
        "--head",
        nargs="+",
        default=["bf16"],
        choices=["bf16", "nvfp4-w4a16"],
        help="the lm_head of the NVFP4 modes: bf16 (the paper's recipe) or random NVFP4 codes "
        "read as a W4A16 linear (rejax.params.quantize_head; bf16 mode keeps bf16); several "
        "values run one variant each, on the same weights",
    )
    ap.add_argument(
        "--weight-prefetch",
        nargs="+",
        default=[rconfig.Config.weight_prefetch],
        help="Config.weight_prefetch specs ('none', 'next[:key=value,...]'); several run one "
        "NVFP4 variant each on the same weights (x each --head), in the order given",
    )
    ap.add_argument(
        "--xla-autotune",
        nargs="+",
        default=["on"],
        choices=["on", "off"],
        help="Config.xla_autotune: several values run every variant once per value, in the "
        "same process",
    )
    ap.add_argument(
        "--samplers",
        nargs="+",
        default=["greedy"],
        choices=sorted(SAMPLERS),
        help="decode-loop samplers to time per batch, in this order (the breakdown runs for "
        "the first); a sampler may repeat. Each non-greedy run is also reported over the greedy "
        "runs beside it (over_greedy_us), so alternate: greedy temp greedy reset greedy",
    )
    ap.add_argument(
        "--logits-dtypes",
        nargs="+",
        default=["head"],
        choices=["head", "float32"],
        help="logits the decode loop carries and samples: the head's dtype (as rejax.generate) "
        "or float32 (the head's cast)",
    )
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--gen-len", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2, help="timed decode runs (median)")
    ap.add_argument("--breakdown-steps", type=int, default=128)
    ap.add_argument("--no-breakdown", action="store_true")
    ap.add_argument("--copy-mib", type=int, default=2048, help="copy-ceiling buffer size")
    ap.add_argument("--out", required=True, help="JSON results path")
    ap.add_argument(
        "--gemv-tma",
        default=None,
        metavar="SPEC",
        help="experiment: the batch-1 W4A4 GEMVs of every variant run the TMA-streamed kernel "
        "(experiments/kernels/nvfp4_gemv_tma.cu), e.g. 'stages=6' or 'producer=lsu,ctas=2,"
        "stages=4' ('default': its defaults); installed before anything is compiled, so the "
        "whole process uses it (compare against a process without it)",
    )
    ap.add_argument(
        "--block-tma",
        default=None,
        metavar="SPEC",
        help="experiment: at batch 1 the post-attention block (o + residual, RMSNorm, gate_up, "
        "SwiGLU, down + residual) of every variant is one launch of "
        "experiments/kernels/nvfp4_block_tma.cu, e.g. 'stages=10' or 'producer=lsu' "
        "('default': its defaults); installed before anything is compiled, as --gemv-tma",
    )
    ap.add_argument(
        "--qkv-tma",
        default=None,
        metavar="SPEC",
        help="experiment: at batch 1 the qkv projection with its input norm and rope_cache of "
        "every variant is one launch of nvfp4_block_tma.cu's pre-attention kernel, e.g. "
        "'stages=10' ('default': its defaults); with or without --block-tma",
    )
    args = ap.parse_args(argv)
    # the experiments' kernel swaps, each installed before anything is compiled
    swaps = {}
    for flag, attr, module, install, types in (
        ("--gemv-tma", "gemv_tma", "nvfp4_gemv_tma", "install", None),
        ("--block-tma", "block_tma", "nvfp4_block_tma", "install", None),
        ("--qkv-tma", "qkv_tma", "nvfp4_block_tma", "install_qkv", "QKV_OPTION_TYPES"),
    ):
        spec, swaps[attr] = getattr(args, attr), None
        if spec is None:
            continue
        mod = importlib.import_module(f"experiments.kernels.{module}")
        try:
            swaps[attr] = mod.parse_options(spec, getattr(mod, types) if types else None)
            getattr(mod, install)(**swaps[attr])
        except (ValueError, mod.KernelError) as err:
            raise SystemExit(f"{flag} {spec!r}: {err}") from None
    cfg = TINY if args.tiny else rconfig.PRESETS[args.preset]
    for spec in args.weight_prefetch:
        try:
            rconfig.weight_prefetch_policy(spec)
        except ValueError as err:
            raise SystemExit(f"--weight-prefetch: {err}") from None
    if args.layers is not None:
        if args.layers <= 0:
            raise SystemExit(f"--layers must be positive, got {args.layers}")
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    cfg = dataclasses.replace(
        cfg,
        layer_loop=args.layer_loop,
        scan_unroll=args.scan_unroll[0],
        **{field: getattr(args, field) for field in CHOICE_FIELDS},
        attention=args.attention[0],
        gemm_occupancy=args.gemm_occupancy[0],
        linear_fusion=args.linear_fusion[0],
        gemm_min_m=args.gemm_min_m,
        gemm_max_m=args.gemm_max_m,
    )
    if args.tiny:  # the kernel choices and --layers apply to the tiny config too
        args.prompt_len, args.gen_len = min(args.prompt_len, 32), min(args.gen_len, 16)
        args.breakdown_steps, args.copy_mib = min(args.breakdown_steps, 8), min(args.copy_mib, 16)
    t_start = time.perf_counter()
    result = {
        "config": dataclasses.asdict(cfg),
        "args": vars(args),
        "versions": rbench.versions(),
        "kernel": _kernel_report(cfg, args.batch),
        # None: production's GEMVs / post-attention block / qkv projection and rope_cache
        **swaps,
        "runs": [],
    }
    result["breakdown_note"] = (
        "each part runs alone in a jitted fori_loop with loop-invariant weights; XLA may hoist "
        "weight-only work out of such loops (the pure-JAX NVFP4 reference unpacks weights, the "
        "CUDA kernel reads packed weights directly), so on the reference path (no GPU) the "
        "linears time is a lower bound and the remainder absorbs the difference"
    )
    result["copy_ceiling_GBps"] = rbench.copy_ceiling(args.copy_mib << 20, args.repeats) / 1e9
    print(f"copy ceiling {result['copy_ceiling_GBps']:.0f} GB/s", flush=True)
    bucket = rgen._bucket(args.prompt_len)
    for mode in args.modes:
        quant = None if mode == "bf16" else mode
        t0 = time.perf_counter()
        base = random_params(dataclasses.replace(cfg, quant=quant))
        jax.block_until_ready(base.weights)
        print(f"[{mode}] weights built in {time.perf_counter() - t0:.1f}s", flush=True)
        for head, spec, variant, params in _variants(base, args, quant):
            _run_variant(args, result, cfg, bucket, mode, head, spec, variant, params)
            del params
        del base
    speed = {}
    for batch in args.batch:
        runs = [
            r
            for r in result["runs"]
            if r["batch"] == batch and r["sampler"] == args.samplers[0] and "error" not in r
        ]
        bf16 = next((r for r in runs if r["mode"] == "bf16"), None)
        nv = [r for r in runs if r["mode"] == "nvfp4"]
        if bf16 and nv:
            speed[f"b{batch}"] = bf16["ms_per_token"] / nv[0]["ms_per_token"]
            for r in nv:
                speed.setdefault("variants", {})[f"b{batch} {r['variant']}"] = (
                    bf16["ms_per_token"] / r["ms_per_token"]
                )
    result["nvfp4_speedup_over_bf16"] = speed
    result["over_greedy_us"] = over_greedy(result["runs"])
    for name, us in result["over_greedy_us"].items():
        print(f"[{name}] over greedy: " + " ".join(f"{x:+.1f}" for x in us) + " us/token")
    result["total_wall_s"] = time.perf_counter() - t_start
    _write(args.out, result)
    print(f"wrote {args.out} ({result['total_wall_s']:.0f}s)", flush=True)
    return result


def _variants(base: Params, args, quant):
    """(head, prefetch spec, label, params) per variant of a mode: bf16 runs once; NVFP4 modes
    once per --head x --weight-prefetch, on the same weights; each once per --xla-autotune
    (labelled " autotune=off" when off) x --attention (labelled " attn=CHOICE" unless Config's
    default) x --command-buffer (labelled " cb=CHOICE" unless "default") x --decode-unroll x
    --scan-unroll (labelled " du=K" / " su=K" unless Config's default); NVFP4 modes also once
    per --gemm-occupancy x --linear-fusion x --attention-output x --gate-up-output x
    --o-proj-output x --gemm-chain x --gemm-wgmma-min-m x --gemm-wgmma-max-m x --gemm-wgmma-raster
    x --gemm-dot-dequant x --gemm-dot-stream x --gemm-dot-finish (labelled " occ=CHOICE" /
    " lf=CHOICE" / " ao=CHOICE" / " go=CHOICE" / " oo=CHOICE" / " gc=CHOICE" / " wg=K" /
    " wgmax=K" / " ras=G" / " dq=CHOICE" / " ds=CHOICE" / " df=CHOICE" unless Config's default;
    the last loop innermost, so its values run adjacent)."""
    runs = [
        (t, a, c, u, k)
        for t in args.xla_autotune
        for a in args.attention
        for c in args.command_buffer
        for u in args.decode_unroll
        for k in args.scan_unroll
    ]
    for tune, attn, cb, unroll, scan in runs:
        tag = ("" if tune == "on" else " autotune=off") + ("" if cb == "default" else f" cb={cb}")
        tag += "" if attn == rconfig.Config.attention else f" attn={attn}"
        tag += "" if unroll == rconfig.Config.decode_unroll else f" du={unroll}"
        tag += "" if scan == rconfig.Config.scan_unroll else f" su={scan}"
        loop = {"decode_unroll": unroll, "scan_unroll": scan, "attention": attn}
        if quant is None:
            cfg = dataclasses.replace(
                base.cfg, xla_autotune=tune == "on", command_buffer=cb, **loop
            )
            yield "bf16", "none", "bf16" + tag, dataclasses.replace(base, cfg=cfg)
            continue
        for head in args.head:
            params = base if head == "bf16" else rparams.quantize_head(base, random_key=1)
            kernels = [
                (p, o, f, ao, go, oo, gc, wgm, wgmax, ras, dq, ds, df)
                for p in args.weight_prefetch
                for o in args.gemm_occupancy
                for f in args.linear_fusion
                for ao in args.attention_output
                for go in args.gate_up_output
                for oo in args.o_proj_output
                for gc in args.gemm_chain
                for wgm in args.gemm_wgmma_min_m
                for wgmax in args.gemm_wgmma_max_m
                for ras in args.gemm_wgmma_raster
                for dq in args.gemm_dot_dequant
                for ds in args.gemm_dot_stream
                for df in args.gemm_dot_finish
            ]
            for spec, occ, fusion, out, gu, op_out, chain, wgm, wgmax, ras, dq, ds, df in kernels:
                cfg = dataclasses.replace(
                    params.cfg,
                    gemm_wgmma_min_m=wgm,
                    gemm_wgmma_max_m=wgmax,
                    gemm_wgmma_raster=ras,
                    gemm_dot_dequant=dq,
                    weight_prefetch=spec,
                    xla_autotune=tune == "on",
                    command_buffer=cb,
                    gemm_occupancy=occ,
                    linear_fusion=fusion,
                    attention_output=out,
                    gate_up_output=gu,
                    o_proj_output=op_out,
                    gemm_chain=chain,
                    gemm_dot_stream=ds,
                    gemm_dot_finish=df,
                    **loop,
                )
                occ_tag = "" if occ == rconfig.Config.gemm_occupancy else f" occ={occ}"
                occ_tag += "" if fusion == rconfig.Config.linear_fusion else f" lf={fusion}"
                occ_tag += "" if out == rconfig.Config.attention_output else f" ao={out}"
                occ_tag += "" if gu == rconfig.Config.gate_up_output else f" go={gu}"
                occ_tag += "" if op_out == rconfig.Config.o_proj_output else f" oo={op_out}"
                occ_tag += "" if chain == rconfig.Config.gemm_chain else f" gc={chain}"
                occ_tag += "" if wgm == rconfig.Config.gemm_wgmma_min_m else f" wg={wgm}"
                occ_tag += "" if wgmax == rconfig.Config.gemm_wgmma_max_m else f" wgmax={wgmax}"
                occ_tag += "" if ras == rconfig.Config.gemm_wgmma_raster else f" ras={ras}"
                occ_tag += "" if dq == rconfig.Config.gemm_dot_dequant else f" dq={dq}"
                occ_tag += "" if ds == rconfig.Config.gemm_dot_stream else f" ds={ds}"
                occ_tag += "" if df == rconfig.Config.gemm_dot_finish else f" df={df}"
                label = f"head={head} prefetch={spec}{tag}{occ_tag}"
                yield head, spec, label, dataclasses.replace(params, cfg=cfg)


def _run_variant(args, result, cfg, bucket, mode, head, spec, variant, params):
    """Times one variant at every --batch and --samplers, appending its runs to `result`."""
    wbytes = _weight_bytes(params)
    print(f"[{mode}] {variant}: weights {wbytes / 1e9:.2f} GB", flush=True)
    runs = [(b, s, d) for b in args.batch for d in args.logits_dtypes for s in args.samplers]
    for batch, sampler, dtype in runs:
        t0 = time.perf_counter()
        carry = None if dtype == "head" else dtype
        try:
            run, cache = _run_generation(params, batch, bucket, args.gen_len, args.repeats, sampler,
                                         carry)  # fmt: skip
        except Exception as err:  # noqa: BLE001 - record the failure, keep benchmarking
            result["runs"].append(
                {
                    "mode": mode,
                    "variant": variant,
                    "head": head,
                    "weight_prefetch": spec,
                    "batch": batch,
                    "sampler": sampler,
                    "logits_dtype": dtype,
                    "error": f"{type(err).__name__}: {err}",
                }
            )
            print(f"[{mode} b{batch} {sampler}] FAILED {err}", flush=True)
            continue
        slots = bucket + args.gen_len
        kv_full = _kv_bytes(cfg, batch, slots)
        kv_live = _kv_bytes(cfg, batch, bucket + args.gen_len / 2)  # mean valid slots
        step_s = run["ms_per_token"] / 1e3
        run.update(
            mode=mode,
            variant=variant,
            head=head,
            weight_prefetch=spec,
            batch=batch,
            sampler=sampler,
            logits_dtype=dtype,
            prompt_len=bucket,
            gen_len=args.gen_len,
            weight_bytes=wbytes,
            kv_bytes_read_per_step=kv_full,
            kv_bytes_valid_mean=kv_live,
            bandwidth_GBps=(wbytes + kv_full) / step_s / 1e9,
            weight_bandwidth_GBps=wbytes / step_s / 1e9,
        )
        run["fraction_of_copy_ceiling"] = run["bandwidth_GBps"] / result["copy_ceiling_GBps"]
        if not args.no_breakdown and sampler == args.samplers[0] and dtype == args.logits_dtypes[0]:
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
        if result.get("block_tma") is not None or result.get("qkv_tma") is not None:
            # how often the block kernels stood in, or why not
            from experiments.kernels import nvfp4_block_tma

            run["block_tma_traces"] = dict(nvfp4_block_tma.TRACES)
        result["runs"].append(run)
        _write(args.out, result)  # partial results survive a timeout
        print(
            f"  first calls: prefill {run['prefill_first_call_s']:.1f} s, decode loop "
            f"{run['decode_first_call_s']:.1f} s (compiled + ran)",
            flush=True,
        )
        print(
            f"[{variant} b{batch} {sampler} {dtype}] {run['ms_per_token']:.3f} ms/token, "
            f"{run['tokens_per_s']:.1f} tok/s, {run['bandwidth_GBps']:.0f} GB/s, "
            f"prefill {run['prefill_ms']:.1f} ms"
            + (f", dominant: {run.get('dominant')}" if "dominant" in run else ""),
            flush=True,
        )


if __name__ == "__main__":
    main(sys.argv[1:])
