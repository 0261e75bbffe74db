"""Greedy tokens and entropies of the bundled tiny model under Config variants, as JSON.

50 test prompts, 128 new tokens, `--stop none` to run past the answer. Run it on two machines
(or on the CPU and a GPU) and compare the files: where rows first differ, and at what entropy.

  PYTHONPATH=. python experiments/tiny_tokens.py --out tokens.json [--variants bf16 nvfp4]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import rejax
from rejax import params as rparams
from rejax.cli import load_model
from rejax.data import tasks

VARIANTS = {
    "bf16": ("bf16", {}),
    "nvfp4": ("nvfp4", {}),
    "nvfp4-unfused": (
        "nvfp4",
        {"linear_fusion": "unfused", "rope_fusion": "unfused", "residual_fusion": "unfused"},
    ),
    # the opt-in NVFP4 W4A16 lm_head (rejax.params.quantize_head) on the W4A4 model
    "nvfp4-head": ("nvfp4", {}),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON path")
    ap.add_argument("--variants", nargs="+", default=["bf16", "nvfp4"], choices=sorted(VARIANTS))
    ap.add_argument("--prompts", type=int, default=50)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--stop", choices=["default", "none"], default="none")
    args = ap.parse_args(argv)
    prompts = [tasks.chat_prompt(p["problem"]) for p in tasks.split("test", args.prompts)]
    out = {}
    for tag in args.variants:
        quant, fields = VARIANTS[tag]
        params = load_model("tiny", quant)
        params = dataclasses.replace(params, cfg=dataclasses.replace(params.cfg, **fields))
        if tag.endswith("-head"):
            params = rparams.quantize_head(params)
        t0 = time.perf_counter()
        gen = rejax.generate(
            params,
            prompts,
            max_new_tokens=args.new_tokens,
            stop=[] if args.stop == "none" else None,
        )
        out[tag] = {"tokens": gen.tokens, "entropy": gen.entropy, "s": time.perf_counter() - t0}
        print(f"{tag}: {out[tag]['s']:.1f} s", flush=True)
    with open(args.out, "w") as f:
        json.dump(out, f)
    return out


if __name__ == "__main__":
    main()
