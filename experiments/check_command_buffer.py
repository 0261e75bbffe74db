"""Tokens under each Config.command_buffer against "default", on the device ([T2-B] item 5).

The while-loop capture records the decode loop, the layer scan inside it and the custom calls
in its body into CUDA graphs. A kernel that captured a buffer address of one iteration would
give wrong tokens from the second layer or step on, so this compares whole generations:
random Qwen3 weights of a preset cut to a few layers (bf16 and NVFP4, several batches,
greedy) and the bundled tiny model with ReSET, token for token, and records the first
mismatch. Usage:

  PYTHONPATH=. python experiments/check_command_buffer.py --layers 2 --out OUT.json
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
import time

import jax
import numpy as np

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import sampling
from rejax.cli import load_model

rgen = importlib.import_module("rejax.generate")  # the package attribute is the function


def _with(params, command_buffer):
    return dataclasses.replace(
        params, cfg=dataclasses.replace(params.cfg, command_buffer=command_buffer)
    )


def _compare(tag, params, prompts, new_tokens, sampler, key=0):
    out = {"case": tag}
    got = {}
    for choice in rconfig.COMMAND_BUFFERS:
        t0 = time.perf_counter()
        gen = rgen.generate(
            _with(params, choice),
            prompts,
            max_new_tokens=new_tokens,
            sampler=sampler,
            key=key,
            stop=[],
        )
        got[choice] = gen
        out[f"{choice}_s"] = time.perf_counter() - t0
    a = got["default"]
    for choice in rconfig.COMMAND_BUFFERS[1:]:
        out[choice] = _same(a, got[choice])
    print(json.dumps(out), flush=True)
    return out


def _same(a, b) -> dict:
    out = {}
    rows = [
        next((i for i, (x, y) in enumerate(zip(ra, rb, strict=True)) if x != y), None)
        for ra, rb in zip(a.tokens, b.tokens, strict=True)
    ]
    out["rows"] = len(rows)
    out["rows_identical"] = sum(r is None for r in rows)
    out["first_mismatch"] = [r for r in rows if r is not None][:8]
    out["entropy_max_abs_diff"] = max(
        float(np.max(np.abs(np.subtract(x, y), dtype=np.float64), initial=0.0))
        for x, y in zip(a.entropy, b.entropy, strict=True)
    )
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["bf16", "nvfp4"], choices=["bf16", "nvfp4"])
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    result = {"versions": rbench.versions(), "device": str(jax.devices()[0]), "cases": []}
    cfg = dataclasses.replace(rconfig.PRESETS[args.preset], num_layers=args.layers)
    rng = np.random.default_rng(0)
    for mode in args.modes:
        params = rbench._random_params(cfg, mode, 0)
        for batch in args.batch:
            prompts = [list(map(int, rng.integers(1, 1000, size=20))) for _ in range(batch)]
            result["cases"].append(
                _compare(
                    f"{args.preset}-{args.layers}l {mode} b{batch} greedy",
                    params,
                    prompts,
                    args.new_tokens,
                    sampling.Greedy(),
                )
            )
    for quant in ("bf16", "nvfp4"):
        tiny = load_model("tiny", quant)
        reset = sampling.ReSET(t_high=1.0, t_low=0.1, top_p=0.95)
        prompts = [f"{a}+{b}=" for a, b in zip(range(10, 26), range(40, 56), strict=True)]
        result["cases"].append(
            _compare(f"tiny {quant} b16 reset", tiny, prompts, args.new_tokens, reset, key=1)
        )
    result["all_identical"] = all(
        c[choice]["rows_identical"] == c[choice]["rows"]
        for c in result["cases"]
        for choice in rconfig.COMMAND_BUFFERS[1:]
    )
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print("all identical:", result["all_identical"], flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["all_identical"] else 1)
