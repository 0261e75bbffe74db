"""Writes a Hugging Face checkpoint of a preset's layer shapes with random weights.

`rejax eval` and `rejax calibrate` read checkpoints, so throughput at real layer shapes (for
example [T2-C]'s 8-layer Qwen3-8B-shape run) needs one on disk. Nothing is downloaded: the
weights are `rejax.params.random_params` (normal(0.02), built on the device, seeded), written
in bf16 with the bundled tiny model's tokenizer, chat template and generation config. The
tokenizer covers the first ids of the preset's vocabulary; the rest decode to "" (the answers
are wrong, and the token counts and times are real).

    PYTHONPATH=. python experiments/random_checkpoint.py --preset qwen3-8b --layers 8 \\
        --out /tmp/qwen3-8b-8l
    rejax eval --model /tmp/qwen3-8b-8l --quant nvfp4 --limit 64 --n 8
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rejax import config as rconfig
from rejax import params as rparams
from rejax.checkpoint import save
from rejax.checkpoint.reader import load
from rejax.data import TINY_MODEL

# what the checkpoint takes from the bundled model besides its tokenizer
COPIED = ("generation_config.json",)


def main(argv=None) -> Path:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (default: 8)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True, help="checkpoint directory to write")
    ap.add_argument(
        "--overwrite", action="store_true", help="replace the model files of an existing --out"
    )
    args = ap.parse_args(argv)
    if args.layers <= 0:
        raise SystemExit(f"--layers must be positive, got {args.layers}")
    out = Path(args.out)
    if (out / "config.json").exists() and not args.overwrite:
        raise SystemExit(f"--out {out} already holds a checkpoint (--overwrite replaces it)")
    tiny = load(TINY_MODEL)
    cfg = dataclasses.replace(
        rconfig.PRESETS[args.preset],
        num_layers=args.layers,
        quant=None,
        bos_token_id=tiny.cfg.bos_token_id,
        eos_token_ids=tiny.cfg.eos_token_ids,
        pad_token_id=tiny.cfg.pad_token_id,
    )
    if cfg.vocab_size < tiny.cfg.vocab_size:
        raise SystemExit(
            f"preset {args.preset} has vocab_size {cfg.vocab_size}, fewer than the bundled "
            f"tokenizer's {tiny.cfg.vocab_size}"
        )
    t0 = time.perf_counter()
    params = rparams.random_params(cfg, args.seed)
    params = dataclasses.replace(params, tokenizer=tiny.tokenizer)
    save(params, out)
    for name in COPIED:
        shutil.copy(TINY_MODEL / name, out / name)
    size = sum(f.stat().st_size for f in out.glob("*.safetensors"))
    print(
        f"wrote {out}: {args.preset} shapes, {args.layers} layers, random weights (seed "
        f"{args.seed}), {size / 1e9:.2f} GB, {time.perf_counter() - t0:.1f}s",
        flush=True,
    )
    return out


if __name__ == "__main__":
    main()
