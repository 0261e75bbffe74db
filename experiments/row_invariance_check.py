"""Does a decode step's per-row arithmetic depend on how many rows the program has? ([T2-L])

Slot compaction (`rejax.slots`, "auto") gathers the live rows of a B-row decode into a program
of C < B rows; its tokens equal the static batches' only if every row's logits come out
bitwise the same at C rows as at B. This runs one decode step of a random model (1 layer of
Qwen3-8B by default, the cache prefilled with random prompts) for all B rows, then for C rows
gathered from them, in several variants, and counts the gathered rows whose written K/V cache
entries (the path up to RoPE) and whose logits equal the B-row program's bitwise:

- quant: bf16 / nvfp4 weights (NVFP4 with static activation scales, as bench_slots uses);
- attention: `Config.attention` ("einsum", "live");
- xla_autotune: `Config.xla_autotune` ("off": cuBLAS for every float matmul, untimed);
  `--hlo-dir` writes each program's optimized HLO and lists its matmuls (beta 1: an add
  fused into the matmul);
- barrier: "off" is `rejax.layers.padded_rows` as it is (the pad, the producer or the
  consumer may fuse into the matmul); "on" swaps in a version with the matmul behind
  optimization barriers, at every row count, so each program has the same matmul.

Every variant runs with `Config.invariant_rows` = B, as compacted decode programs do.

    PYTHONPATH=. python3 experiments/row_invariance_check.py --out OUT.json          # GPU
    PYTHONPATH=. python3 experiments/row_invariance_check.py --small                 # CPU
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import math
import re
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_slots

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import decoder, layers
from rejax.cache import KVCache, init_cache
from rejax.decode import prefill

PADDED_ROWS = layers.padded_rows


def padded_rows_barrier(fn, x, rows, residual=None):
    """`layers.padded_rows` with the matmul behind optimization barriers (also at `rows` rows):
    every program then has the same [rows, K] x [K, N] matmul, nothing fused into it."""
    lead = x.shape[:-1]
    m = math.prod(lead)
    if rows is None or m > rows or m == 0:
        return fn(x) if residual is None else residual + fn(x)

    def pad(a):
        return jnp.pad(jnp.reshape(a, (m, a.shape[-1])), ((0, rows - m), (0, 0)))

    y = jax.lax.optimization_barrier(fn(jax.lax.optimization_barrier(pad(x))))
    if residual is not None:
        y = pad(residual) + y
    y = y[:m]
    return jnp.reshape(y, (*lead, y.shape[-1]))


def set_barrier(on: bool) -> None:
    f = padded_rows_barrier if on else PADDED_ROWS
    layers.padded_rows = f
    decoder.padded_rows = f  # imported by name there


def gather_cache(c: KVCache, idx) -> KVCache:
    def rows(a):
        return None if a is None else a[:, idx]

    return KVCache(
        k=c.k[:, idx], v=c.v[:, idx], positions=c.positions[idx], index=c.index[idx],
        k_scale=rows(c.k_scale), v_scale=rows(c.v_scale),
    )  # fmt: skip


def step_fn(cfg, hlo_dir=None, tag=""):
    """One jitted decode step, compiled with `cfg`'s compiler options (`Config.xla_autotune`);
    with `hlo_dir`, each compiled program's optimized HLO is written there and its matmul
    custom calls are returned by `matmul_calls`."""

    def step(weights, tokens, positions, cache):
        logits, cache = decoder.forward(weights, tokens[:, None], positions[:, None], cache, cfg)
        return logits[:, 0], cache

    opts = rconfig.compiler_options(cfg) or {}
    jitted = jax.jit(step, compiler_options=opts) if opts else jax.jit(step)
    if hlo_dir is None:
        return jitted
    compiled = {}

    def run(weights, tokens, positions, cache):
        rows = int(tokens.shape[0])
        if rows not in compiled:
            exe = jitted.lower(weights, tokens, positions, cache).compile()
            text = exe.as_text()
            Path(hlo_dir).mkdir(parents=True, exist_ok=True)
            (Path(hlo_dir) / f"{tag}_rows{rows}.hlo.txt").write_text(text)
            compiled[rows] = exe
            MATMULS[(tag, rows)] = matmul_calls(text)
        return compiled[rows](weights, tokens, positions, cache)

    return run


MATMULS: dict = {}


def matmul_calls(hlo: str) -> list[str]:
    """The matmul custom calls (cuBLAS, cuBLASLt) and Triton GEMM fusions of an optimized HLO
    module, one line each: the result shape, the target and, for cuBLAS, its beta (1: an add
    fused into the matmul's epilogue)."""
    out = []
    for line in hlo.splitlines():
        line = line.strip()
        target = re.search(r'custom_call_target="([^"]+)"', line)
        if target and ("cublas" in target.group(1) or "gemm" in target.group(1).lower()):
            shape = line.split("=", 1)[1].split(" custom-call(")[0].strip()
            beta = re.search(r'"beta":([-0-9.e]+)', line)
            epi = re.search(r'"epilogue":"([A-Z_]+)"', line)
            out.append(f"{target.group(1)} {shape[:120]} beta={beta.group(1) if beta else '?'}"
                       f" epilogue={epi.group(1) if epi else '-'}")  # fmt: skip
        elif "__triton_gemm" in line and " fusion(" in line:
            shape = line.split("=", 1)[1].split(" fusion(")[0].strip()
            out.append(f"triton_gemm {shape[:120]}")
    return out


def check_variant(
    base_cfg, quant, attention, barrier, slots, sizes, prompt_len, seed, autotune=True,
    hlo_dir=None,
):  # fmt: skip
    set_barrier(barrier == "on")
    cfg = dataclasses.replace(
        base_cfg,
        quant=None if quant == "bf16" else quant,
        attention=attention,
        invariant_rows=slots,
        xla_autotune=autotune,
    )
    params = bench_slots.random_params(cfg, seed)
    rng = np.random.default_rng(seed)
    length = prompt_len + 8
    tokens = jnp.asarray(rng.integers(0, cfg.vocab_size, (slots, prompt_len)), jnp.int32)
    # rows of different prompt lengths (left-padded), as refilled slots have
    lens = rng.integers(prompt_len // 2, prompt_len + 1, slots)
    pos = np.arange(prompt_len)[None, :] - (prompt_len - lens[:, None])
    positions = jnp.asarray(np.where(pos >= 0, pos, -1), jnp.int32)
    cache = init_cache(cfg, slots, length, jnp.bfloat16)
    p_cfg = dataclasses.replace(params, cfg=dataclasses.replace(cfg, invariant_rows=None))
    logits0, cache = prefill(p_cfg, tokens, positions, cache)
    # a per-row write index, as the slots' cache has (every row wrote prompt_len slots)
    index = jnp.broadcast_to(jnp.asarray(cache.index, jnp.int32), (slots,))
    cache = dataclasses.replace(cache, index=index)
    nxt = jnp.argmax(logits0, axis=-1).astype(jnp.int32)
    npos = jnp.asarray(lens, jnp.int32)
    tag = f"{quant}_{attention}_barrier-{barrier}_autotune-{'on' if autotune else 'off'}"
    step = step_fn(cfg, hlo_dir, tag)
    t0 = time.perf_counter()
    full_logits, full_cache = jax.block_until_ready(step(params.weights, nxt, npos, cache))
    out = {"quant": quant, "attention": attention, "barrier": barrier,
           "xla_autotune": autotune, "sizes": {}}  # fmt: skip
    out["compile_and_run_s"] = round(time.perf_counter() - t0, 2)
    full_logits = np.asarray(full_logits)
    kw = np.asarray(full_cache.k[:, :].astype(jnp.float32))
    vw = np.asarray(full_cache.v[:, :].astype(jnp.float32))
    for c in sizes:
        idx = np.sort(rng.choice(slots, c, replace=False))
        sub = gather_cache(cache, jnp.asarray(idx))
        lg, cc = jax.block_until_ready(step(params.weights, nxt[idx], npos[idx], sub))
        lg = np.asarray(lg)
        ck = np.asarray(cc.k.astype(jnp.float32))
        cv = np.asarray(cc.v.astype(jnp.float32))
        rows_kv = [
            bool(np.array_equal(ck[:, j], kw[:, r]) and np.array_equal(cv[:, j], vw[:, r]))
            for j, r in enumerate(idx)
        ]
        rows_lg = [bool(np.array_equal(lg[j], full_logits[r])) for j, r in enumerate(idx)]
        diff = float(np.max(np.abs(lg - full_logits[idx])))
        argmax = int(np.sum(np.argmax(lg, -1) == np.argmax(full_logits[idx], -1)))
        out["sizes"][str(c)] = {
            "rows": c,
            "kv_equal_rows": int(sum(rows_kv)),
            "logits_equal_rows": int(sum(rows_lg)),
            "max_abs_logit_diff": diff,
            "argmax_equal_rows": argmax,
        }
        print(
            f"[{tag}] C={c}: K/V equal {sum(rows_kv)}/{c}, "
            f"logits equal {sum(rows_lg)}/{c}, max |diff| {diff:.3g}, argmax equal {argmax}/{c}",
            flush=True,
        )
    if hlo_dir is not None:
        out["matmuls"] = {str(r): MATMULS.get((tag, r), []) for r in [slots, *sizes]}
        for r, calls in out["matmuls"].items():
            print(f"[{tag}] matmuls at {r} rows:", *calls, sep="\n  ", flush=True)
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--slots", type=int, default=64, help="B rows of the full program")
    ap.add_argument("--sizes", type=int, nargs="+", default=[32, 16], help="C rows gathered")
    ap.add_argument("--quant", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    ap.add_argument(
        "--attention", nargs="+", default=["einsum", "live"], choices=list(rconfig.ATTENTIONS)
    )
    ap.add_argument("--barrier", nargs="+", default=["on", "off"], choices=["on", "off"])
    ap.add_argument(
        "--xla-autotune", nargs="+", default=["on"], choices=["on", "off"],
        help="Config.xla_autotune per variant (off: rejax.config.NO_AUTOTUNE_OPTIONS)",
    )  # fmt: skip
    ap.add_argument("--hlo-dir", default=None,
                    help="write each program's optimized HLO here and list its matmuls")  # fmt: skip
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny config (CPU smoke)")
    ap.add_argument("--out", default=None, help="JSON results path")
    args = ap.parse_args(argv)
    bad = [c for c in args.sizes if not 0 < c < args.slots]
    if bad:
        raise SystemExit(f"--sizes {bad}: each must be in [1, --slots={args.slots})")
    cfg = bench_slots.SMALL if args.small else rconfig.PRESETS[args.preset]
    cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if args.small:
        args.prompt_len = min(args.prompt_len, 16)
    result = {"args": vars(args), "versions": rbench.versions(), "variants": []}
    combos = itertools.product(args.quant, args.attention, args.barrier, args.xla_autotune)
    for quant, att, bar, tune in combos:
        try:
            r = check_variant(cfg, quant, att, bar, args.slots, args.sizes, args.prompt_len,
                              args.seed, tune == "on", args.hlo_dir)  # fmt: skip
        except Exception as err:  # noqa: BLE001  (a variant that fails is a result)
            r = {"quant": quant, "attention": att, "barrier": bar, "xla_autotune": tune == "on",
                 "error": repr(err)[:500]}  # fmt: skip
            print(f"[{quant} {att} barrier={bar}] FAILED {err!r}"[:400], flush=True)
        result["variants"].append(r)
    set_barrier(True)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
