"""What the compiled decode step moves: HLO size and large copies, per layer count and mode.

Compiles `rejax.decode.decode_step` for random weights of a preset's widths (abstract shapes,
no weights materialized) at two depths, and reports from the optimized HLO: the instruction
count (the scanned decoder must not grow with depth), every `copy` / `dynamic-slice` /
`dynamic-update-slice` instruction (fused or not) whose result is at least `--min-mib` MiB (a
weight or KV-cache slice copied out of its stack would show up here), and the custom calls.

    PYTHONPATH=. python3 experiments/hlo_report.py --layers 2 36 --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import sys

import jax
import jax.numpy as jnp

from rejax import config as rconfig
from rejax import params as rparams
from rejax import sampling
from rejax.cache import init_cache
from rejax.decode import decode_step

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
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--slots", type=int, default=1536)
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
            hlo = compiled_step(cfg, args.batch, args.slots).as_text()
            rep = report(hlo, int(args.min_mib * (1 << 20)))
            rep.update(mode=mode, layers=layers)
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
