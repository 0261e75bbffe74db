"""The sharded code path against the plain one, in the same run: ms/token of the decode loop.

For one config with random weights (default Qwen3-8B, nothing downloaded) and each quant mode
and batch size, it times `rejax.bench.bench_decode` (the jitted prefill and decode loop behind
`rejax bench`: greedy, no early stop, median of repeated calls, first call apart) on the plain
one-device Params and on the same weights placed by `rejax.shard` on a mesh (default
data=1,model=1: the acceptance check that the shard_map path costs nothing on one GPU). The
two are timed alternately, `--rounds` times, and the median of each is reported with the ratio
sharded / plain. With a mesh of several devices it is the first multi-device measurement
(the plain path stays on device 0).

    PYTHONPATH=. python3 experiments/bench_sharding.py --out OUT.json            # H200, 1x1
    PYTHONPATH=. python3 experiments/bench_sharding.py --mesh model=2 --out OUT.json
    PYTHONPATH=. python3 experiments/bench_sharding.py --tiny                    # CPU, seconds
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import generate, sharding

TINY = rconfig.Config(
    vocab_size=512,
    hidden_size=256,
    intermediate_size=512,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=64,
)


def _log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def compare(cfg, quant, batch, mesh, *, vocab, new_tokens, prompt_len, repeats, rounds, seed):
    """Times plain and sharded Params of the same random weights alternately; one dict."""
    plain = rbench._random_params(cfg, quant, seed)
    placed = sharding.shard(plain, mesh, vocab=vocab)
    kw = {"batch": batch, "new_tokens": new_tokens, "prompt_len": prompt_len, "repeats": repeats}
    runs = {"plain": [], "sharded": []}
    for _ in range(rounds):
        for name, params in (("plain", plain), ("sharded", placed)):
            runs[name].append(rbench.bench_decode(params, seed=seed, **kw))
    ms = {k: statistics.median(r["ms_per_token"] for r in v) for k, v in runs.items()}
    # the same greedy tokens from both (random weights; token-id prompts)
    prompts = [[(7 * i + 3 * j) % cfg.vocab_size for j in range(8)] for i in range(batch)]
    same = [
        generate(params, prompts, max_new_tokens=32, stop=[]).tokens for params in (plain, placed)
    ]
    return {
        "greedy_tokens_equal": same[0] == same[1],
        "quant": quant,
        "batch": batch,
        "ms_per_token_plain": ms["plain"],
        "ms_per_token_sharded": ms["sharded"],
        "ratio_sharded_over_plain": ms["sharded"] / ms["plain"],
        "first_call_s": {
            k: v[0]["prefill_first_call_s"] + v[0]["decode_first_call_s"] for k, v in runs.items()
        },
        "runs": runs,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--tiny", action="store_true", help="a tiny config (CPU smoke run)")
    ap.add_argument("--layers", type=int, default=None, help="keep only N decoder layers")
    ap.add_argument("--quant", nargs="+", default=["nvfp4", "bf16"], choices=sorted(rbench.QUANTS))
    ap.add_argument("--batch", nargs="+", type=int, default=[1, 8])
    ap.add_argument("--new-tokens", type=int, default=256)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per bench_decode")
    ap.add_argument("--rounds", type=int, default=3, help="alternations plain / sharded")
    ap.add_argument("--mesh", default="data=1,model=1", metavar="data=D,model=M")
    ap.add_argument("--vocab", default="split", choices=sharding.VOCAB_MODES)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, help="write the results as JSON")
    args = ap.parse_args(argv)

    cfg = TINY if args.tiny else rconfig.PRESETS[args.preset]
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    if args.tiny:
        args.new_tokens, args.prompt_len = min(args.new_tokens, 16), min(args.prompt_len, 16)
    mesh = sharding.make_mesh(**sharding.parse_mesh(args.mesh))
    rows = []
    for quant in args.quant:
        for batch in args.batch:
            _log(f"# {quant} batch {batch}: plain vs mesh {args.mesh} ({args.vocab} vocabulary)")
            r = compare(
                cfg,
                quant,
                batch,
                mesh,
                vocab=args.vocab,
                new_tokens=args.new_tokens,
                prompt_len=args.prompt_len,
                repeats=args.repeats,
                rounds=args.rounds,
                seed=args.seed,
            )
            _log(
                f"  plain {r['ms_per_token_plain']:.3f} ms/token, sharded "
                f"{r['ms_per_token_sharded']:.3f} ms/token, ratio "
                f"{r['ratio_sharded_over_plain']:.3f}; greedy tokens equal: "
                f"{r['greedy_tokens_equal']}"
            )
            rows.append(r)
    result = {
        "config": dataclasses.asdict(cfg),
        "preset": None if args.tiny else args.preset,
        "mesh": dict(mesh.shape),
        "vocab": args.vocab,
        "new_tokens": args.new_tokens,
        "prompt_len": args.prompt_len,
        "repeats": args.repeats,
        "rounds": args.rounds,
        "versions": rbench.versions(),
        "results": rows,
    }
    print(f"{'quant':<12} {'batch':>5} {'plain ms/tok':>12} {'sharded ms/tok':>14} {'ratio':>6}")
    for r in rows:
        print(
            f"{r['quant']:<12} {r['batch']:>5} {r['ms_per_token_plain']:>12.3f} "
            f"{r['ms_per_token_sharded']:>14.3f} {r['ratio_sharded_over_plain']:>6.3f}"
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
