"""What the compiled decode step (or prefill) moves: HLO size and large copies, per layer
count and mode.

Compiles `rejax.decode.decode_step` (`--phase prefill`: `rejax.decode.prefill` of
`--prompt-len` tokens a row) for random weights of a preset's widths (abstract shapes, no
weights materialized; NVFP4 linears with static input scales, as `bench_decode.py`) at two
depths, and reports from the optimized HLO: the instruction count (the scanned decoder must not
grow with depth), every `copy` / `dynamic-slice` / `dynamic-update-slice` instruction (fused or
not) whose result is at least `--min-mib` MiB (a weight or KV-cache slice copied out of its
stack would show up here), and the custom calls. `--hlo-dir` also writes each optimized HLO
(gzipped text) for reading offline.

    PYTHONPATH=. python3 experiments/hlo_report.py --layers 2 36 --out OUT.json
    PYTHONPATH=. python3 experiments/hlo_report.py --phase prefill --batch 8 --layers 8 \
        --hlo-dir OUT_DIR --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gzip
import json
import os
import re
import sys

import jax
import jax.numpy as jnp

from rejax import config as rconfig
from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.decode import decode_step, prefill

_DTYPE_BYTES = {"bf16": 2, "f16": 2, "f32": 4, "s32": 4, "u32": 4, "u8": 1, "s8": 1, "pred": 1}
_SHAPE = re.compile(r"\b(bf16|f16|f32|s32|u32|u8|s8|pred)\[([0-9,]*)\]")


def _bytes(shape_text: str) -> int:
    m = _SHAPE.search(shape_text)
    if not m:
        return 0
    n = 1
    for d in filter(None, m.group(2).split(",")):
        n *= int(d)
    return n * _DTYPE_BYTES[m.group(1)]


def compiled_step(cfg: rconfig.Config, batch: int, slots: int):
    """The compiled decode step for abstract weights and cache of `cfg`."""
    params = jax.eval_shape(lambda: rparams.random_params(cfg, 0))
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, slots))
    sampler = sampling.Greedy()
    state = jax.eval_shape(lambda: sampling.sampler_init(sampler, batch))
    logits = jax.ShapeDtypeStruct((batch, cfg.vocab_size), jnp.float32)
    pos = jax.ShapeDtypeStruct((batch,), jnp.int32)
    keys = jax.eval_shape(lambda: jax.random.split(jax.random.key(0), batch))
    step = jax.ShapeDtypeStruct((), jnp.int32)
    return decode_step.lower(params, logits, cache, pos, sampler, state, keys, step).compile()


def _static_scales(params):
    """NVFP4 linears with static activation scales (as bench_decode.random_params)."""
    cfg = params.cfg
    scale = jnp.full((cfg.num_layers,), 4.0 / (6 * 448), jnp.float32)
    weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
    return dataclasses.replace(params, weights=weights)


def compiled_prefill(cfg: rconfig.Config, batch: int, prompt_len: int, slots: int):
    """The compiled prefill of `prompt_len` tokens a row for abstract weights and cache."""

    def build():
        p = rparams.random_params(cfg, 0)
        return _static_scales(p) if cfg.quant == "nvfp4" else p

    params = jax.eval_shape(build)
    cache = jax.eval_shape(lambda: init_cache(cfg, batch, slots))
    tokens = jax.ShapeDtypeStruct((batch, prompt_len), jnp.int32)
    return prefill.lower(params, tokens, tokens, cache).compile()


def report(hlo: str, min_bytes: int) -> dict:
    lines = [
        ln.strip() for ln in hlo.splitlines() if " = " in ln and not ln.strip().startswith("//")
    ]
    big = []
    for ln in lines:
        _, _, rhs = ln.partition(" = ")
        head = rhs.split("(")[0].split() if "(" in rhs else []
        op = head[-1] if head else ""
        if op in ("copy", "dynamic-slice", "dynamic-update-slice", "fusion", "custom-call"):
            size = _bytes(rhs)
            if size >= min_bytes and op != "custom-call":
                big.append({"op": op, "bytes": size, "text": ln[:240]})
    return {
        "instructions": len(lines),
        "custom_calls": sum(" custom-call(" in ln for ln in lines),
        "large_results": big,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", nargs="+", type=int, default=[2, 36])
    ap.add_argument("--modes", nargs="+", default=["bf16", "nvfp4"])
    ap.add_argument("--phase", default="decode", choices=["decode", "prefill"])
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512, help="prefill tokens a row")
    ap.add_argument("--slots", type=int, default=1536)
    ap.add_argument("--hlo-dir", default=None, help="write each optimized HLO here (.txt.gz)")
    ap.add_argument("--min-mib", type=float, default=1.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    out = {"backend": jax.default_backend(), "args": vars(args), "runs": []}
    for mode in args.modes:
        for layers in args.layers:
            cfg = dataclasses.replace(
                rconfig.PRESETS[args.preset],
                num_layers=layers,
                quant=None if mode == "bf16" else mode,
            )
            if args.phase == "prefill":
                if args.prompt_len > args.slots:
                    raise SystemExit(f"--prompt-len {args.prompt_len} > --slots {args.slots}")
                compiled = compiled_prefill(cfg, args.batch, args.prompt_len, args.slots)
            else:
                compiled = compiled_step(cfg, args.batch, args.slots)
            hlo = compiled.as_text()
            rep = report(hlo, int(args.min_mib * (1 << 20)))
            rep.update(mode=mode, layers=layers, phase=args.phase)
            if args.hlo_dir:
                os.makedirs(args.hlo_dir, exist_ok=True)
                name = f"{args.phase}_{mode}_L{layers}_b{args.batch}.hlo.txt.gz"
                with gzip.open(os.path.join(args.hlo_dir, name), "wt") as f:
                    f.write(hlo)
            out["runs"].append(rep)
            print(
                f"[{mode} L={layers}] {rep['instructions']} instructions, "
                f"{rep['custom_calls']} custom calls, {len(rep['large_results'])} results "
                f">= {args.min_mib} MiB",
                flush=True,
            )
            for b in rep["large_results"][:12]:
                print(f"    {b['bytes'] / 2**20:9.1f} MiB  {b['text'][:160]}", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main(sys.argv[1:])
