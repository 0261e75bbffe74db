"""Trains a Qwen3 search reasoner on Countdown traces (rejax.data.countdown), and exports it.

The recipe is experiments/train_tiny_reasoner.py's (its tokenizer, encoding, optimizer loop
and export are reused, not copied): seeded Countdown problems of the train split
with backtracking search traces, a byte-level BPE tokenizer trained on them, a Qwen3 decoder
trained with AdamW on the solution tokens (bf16 compute, float32 master weights, cosine
schedule), a Hugging Face Qwen3 checkpoint (config.json, bf16 model.safetensors, tokenizer.json,
tokenizer_config.json with the chat template, generation_config.json) that `rejax.load` and
transformers read, and the exported checkpoint's greedy accuracy on validation problems
(rejax.generate with the KV cache, graded by rejax.eval.grading, task "countdown").
`reset.json` is written later by experiments/search_reasoner_accuracy.py, from the calibration
it runs.

The model should be weak enough to be unsure where the search branches (BF16 avg@8 between
40% and 85%): size (`--size`), training length (`--steps` / `--time-budget`) and the task's
difficulty (`--max-number`, `--max-target`, `--guide`, ...) are the knobs.

A run longer than one device call continues from the previous call's export with `--init`
(the same size, seed and task; the optimizer state and schedule start again).

One H200, about 5 minutes of device time a call (the bundled rejax/data/countdown is size s:
320 s from scratch, then 270 s more with --init):
    PYTHONPATH=. python experiments/train_search_reasoner.py --size s --out experiments/results \\
        --export /tmp/countdown_s --time-budget 320
On two CPU cores `--size xs` (1.4M parameters) at `--batch 32` takes ~1.4 s a step; with
`--n-numbers 3 --max-number 30` (traces <= 176 tokens; >= 1000 distinct test problems) 1055
steps reached 35.9% greedy validation accuracy (experiments/results/countdown_cpu_pilot).
CPU smoke run (a 2-layer model, a few steps; a minute or two, mostly compilation):
    PYTHONPATH=. python experiments/train_search_reasoner.py --out /tmp/cd --smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing
import os
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny_reasoner as tiny  # the sibling script whose recipe this reuses

from rejax.bench import versions
from rejax.config import Config
from rejax.data import countdown
from rejax.params import init_params

# Model sizes. D, F and N*H are multiples of 256 (the CUDA NVFP4 GEMV needs K % 256 == 0).
# bf16 checkpoint sizes: s 13 MB, m 39 MB (the bundled models together stay <= 60 MB).
SIZES = {
    "s": {
        "hidden_size": 256,
        "intermediate_size": 768,
        "num_layers": 8,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 32,
    },
    "m": {
        "hidden_size": 512,
        "intermediate_size": 1536,
        "num_layers": 6,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 64,
    },
    "xs": {
        "hidden_size": 256,
        "intermediate_size": 512,
        "num_layers": 2,
        "num_heads": 8,
        "num_kv_heads": 4,
        "head_dim": 32,
    },
    "smoke": {
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 16,
    },
}
DATA_CHUNKS = 16  # independent problem streams (seeds seed*1000 + c) that make up the train set


def _generate_chunk(job):
    seed, n, difficulty = job
    it = countdown.iter_split("train", seed, difficulty)
    return [next(it) for _ in range(n)]


def generate_train(n: int, seed: int, difficulty, workers: int) -> list[dict]:
    """`n` training problems from DATA_CHUNKS seeded streams; independent of `workers`."""
    per = -(-n // DATA_CHUNKS)
    jobs = [(seed * 1000 + c, per, difficulty) for c in range(DATA_CHUNKS)]
    if workers == 1:
        chunks = [_generate_chunk(job) for job in jobs]
    else:
        with multiprocessing.get_context("spawn").Pool(workers) as pool:
            chunks = pool.map(_generate_chunk, jobs)
    return [p for chunk in chunks for p in chunk][:n]


def greedy_validation(model_dir: Path, problems: list[dict], max_new_tokens: int) -> dict:
    """Greedy accuracy of the exported checkpoint on chat-formatted `problems`, decoded by
    rejax.generate with its KV cache and graded exactly (task "countdown"); a few samples kept."""
    import rejax
    from rejax.eval.grading import grade

    params = rejax.load(model_dir)
    gen = rejax.generate(
        params, [p["problem"] for p in problems], max_new_tokens=max_new_tokens, chat=True
    )
    refs = [{"numbers": p["numbers"], "target": p["target"]} for p in problems]
    correct = [grade(t, r, task="countdown") for t, r in zip(gen.text, refs)]
    acc = tiny.accuracy_summary(problems, gen.text, correct)
    acc["finished"] = sum(r == "stop" for r in gen.finish_reason)
    return acc


def _difficulty(args) -> countdown.Difficulty:
    return countdown.Difficulty(
        n_numbers=args.n_numbers,
        max_number=args.max_number,
        min_target=args.min_target,
        max_target=args.max_target,
        max_solutions=args.max_solutions,
        guide=args.guide,
        max_wrong=args.max_wrong,
        dead_tries=args.dead_tries,
    )


def init_weights(path: str | os.PathLike, cfg: Config, tok) -> dict:
    """Float32 weights of an exported checkpoint that this run's model and tokenizer match.

    Raises:
        ValueError: the checkpoint is missing, or its config or tokenizer differ from this
            run's (another size, seed or task); the message names the first difference.
    """
    from rejax.checkpoint.reader import load

    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"--init {path}: no exported checkpoint there (config.json missing)")
    theirs = json.loads((path / "tokenizer.json").read_text()).get("model", {})
    ours = json.loads(tok.to_str()).get("model", {})
    if (theirs.get("vocab"), theirs.get("merges")) != (ours.get("vocab"), ours.get("merges")):
        raise ValueError(
            f"--init {path}: its tokenizer's vocabulary differs from this run's (trained on other "
            "data: use the --seed, task and --train-examples of the run that exported it)"
        )
    params = load(path, dtype=jnp.float32)
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
              "num_kv_heads", "head_dim", "eos_token_ids", "pad_token_id")  # fmt: skip
    for name in fields:
        if getattr(params.cfg, name) != getattr(cfg, name):
            raise ValueError(
                f"--init {path}: {name}={getattr(params.cfg, name)!r} there, "
                f"{getattr(cfg, name)!r} in this run (--size / --layers)"
            )
    fresh = jax.eval_shape(lambda: init_params(cfg, jax.random.key(0), dtype=jnp.float32).weights)
    if jax.tree.structure(fresh) != jax.tree.structure(params.weights):
        raise ValueError(f"--init {path}: its weights do not have this model's structure")
    return jax.tree.map(lambda x: jnp.asarray(x, jnp.float32), params.weights)


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="results folder (metrics JSON, loss PNG)")
    ap.add_argument("--export", default=None, help="checkpoint folder (default OUT/countdown)")
    ap.add_argument("--smoke", action="store_true", help="CPU smoke run: tiny model, 4 steps")
    ap.add_argument("--size", choices=sorted(SIZES), default="m")
    ap.add_argument("--layers", type=int, default=None, help="override the size's layer count")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--init",
        default=None,
        help="continue from this exported checkpoint (its weights; fresh optimizer state and "
        "schedule): the same --size, --layers, --seed and task, so its tokenizer and config "
        "equal this run's (checked); chains runs longer than one device call",
    )
    ap.add_argument("--steps", type=int, default=4000, help="maximum optimizer steps")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        help="seconds of training; caps --steps from the measured step time",
    )
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=1.5e-3)
    ap.add_argument("--warmup", type=int, default=200)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--seq-len", type=int, default=512, help="longer training texts are dropped")
    ap.add_argument("--train-examples", type=int, default=300_000)
    ap.add_argument("--val-examples", type=int, default=256, help="greedy accuracy problems")
    ap.add_argument(
        "--raw-every",
        type=int,
        default=5,
        help="every k-th training sequence uses the plain prompt (0: never)",
    )
    ap.add_argument("--eval-every", type=int, default=500)
    ap.add_argument("--workers", type=int, default=max(1, min(16, os.cpu_count() or 1)))
    d = countdown.DEFAULT
    g = ap.add_argument_group("task difficulty (rejax.data.countdown.Difficulty)")
    g.add_argument("--n-numbers", type=int, default=d.n_numbers)
    g.add_argument("--max-number", type=int, default=d.max_number)
    g.add_argument("--min-target", type=int, default=d.min_target)
    g.add_argument("--max-target", type=int, default=d.max_target)
    g.add_argument("--max-solutions", type=int, default=d.max_solutions)
    g.add_argument("--guide", type=float, default=d.guide)
    g.add_argument("--max-wrong", type=int, default=d.max_wrong)
    g.add_argument("--dead-tries", type=int, default=d.dead_tries)
    args = ap.parse_args(argv)
    if args.smoke:
        args.size, args.batch, args.warmup, args.eval_every = "smoke", 8, 2, 2
        args.steps, args.train_examples, args.val_examples = 4, 400, 4
        args.time_budget, args.workers = None, 1
    if args.layers is not None and args.layers <= 0:
        raise ValueError(f"--layers must be positive, got {args.layers}")
    for name in ("steps", "batch", "seq_len", "train_examples", "eval_every", "val_examples"):
        if getattr(args, name) <= 0:
            raise ValueError(
                f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}"
            )
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    difficulty = _difficulty(args)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    export_dir = Path(args.export) if args.export else out / "countdown"
    t_start = time.perf_counter()

    # Data and tokenizer. Byte-level BPE: a text of c ASCII characters has at most c tokens,
    # so dropping texts longer than seq_len characters keeps every sequence within seq_len.
    generated = generate_train(args.train_examples, args.seed, difficulty, args.workers)
    train = [p for p in generated if len(countdown.training_text(p)) < args.seq_len]
    val = countdown.split("validation", max(args.val_examples, 64), seed=0, difficulty=difficulty)
    tok = tiny.build_tokenizer(
        [countdown.training_text(p, chat=i % 2 == 0) for i, p in enumerate(train[:20_000])]
    )
    ids, mask = tiny.encode_examples(tok, train, args.raw_every, args.seq_len)
    val_short = [p for p in val if len(countdown.training_text(p)) < args.seq_len][:64]
    val_ids, val_mask = tiny.encode_examples(tok, val_short, 0, args.seq_len)
    t_data = time.perf_counter() - t_start
    print(
        f"data: {len(train)} train sequences ({len(generated) - len(train)} longer than "
        f"{args.seq_len} dropped) of length {ids.shape[1]}, vocab {tok.get_vocab_size()}, "
        f"{t_data:.1f}s; {difficulty}",
        flush=True,
    )

    eos, pad = tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")
    vocab = -(-tok.get_vocab_size() // 128) * 128
    cfg = Config(
        arch="qwen3",
        vocab_size=vocab,
        rope_theta=10_000.0,
        max_position_embeddings=1024,
        bos_token_id=pad,
        eos_token_ids=(eos, pad),
        pad_token_id=pad,
        **{**SIZES[args.size], **({"num_layers": args.layers} if args.layers else {})},
    )
    if args.init:
        weights = init_weights(args.init, cfg, tok)
        print(f"init: weights of {args.init} (fresh optimizer state and schedule)", flush=True)
    else:
        weights = init_params(cfg, jax.random.key(args.seed), dtype=jnp.float32).weights
    n_params = sum(int(x.size) for x in jax.tree.leaves(weights))
    print(f"model: {n_params / 1e6:.2f}M params, {cfg}", flush=True)

    weights, history, total, train_seconds, step_ms = tiny.train_loop(
        weights, cfg, ids, mask, val_ids, val_mask, args
    )

    tiny.export(weights, cfg, tok, export_dir)
    countdown.save_difficulty(export_dir, difficulty)  # the test problems come from the same family
    gen_path = export_dir / "generation_config.json"
    gen_cfg = json.loads(gen_path.read_text())
    gen_cfg["max_new_tokens"] = args.seq_len
    gen_path.write_text(json.dumps(gen_cfg, indent=2) + "\n")

    t_eval = time.perf_counter()
    acc = greedy_validation(
        export_dir, val[: args.val_examples], 64 if args.smoke else args.seq_len
    )
    eval_seconds = time.perf_counter() - t_eval
    print(
        f"greedy validation accuracy {acc['accuracy']:.3f} ({acc['correct']}/{acc['n']}), "
        f"{eval_seconds:.0f}s",
        flush=True,
    )

    size = (export_dir / "model.safetensors").stat().st_size
    lengths = mask.sum(axis=1)
    metrics = {
        "args": {k: v for k, v in vars(args).items() if k not in ("out", "export")},
        "difficulty": dataclasses.asdict(difficulty),
        "config": dataclasses.asdict(cfg),
        "params": n_params,
        "checkpoint_bytes": size,
        "tokenizer_vocab": tok.get_vocab_size(),
        "train_sequences": len(ids),
        "seq_len": int(ids.shape[1]),
        "solution_tokens": {
            "mean": float(lengths.mean()),
            "p50": float(np.median(lengths)),
            "max": int(lengths.max()),
        },
        "steps": total,
        "tokens_seen": int(total * args.batch * (ids.shape[1] - 1)),
        "final_train_loss": float(np.mean(history["train_loss"][-50:])),
        "final_val_loss": history["val_loss"][-1],
        "greedy_validation": acc,
        "seconds": {
            "data": t_data,
            "train": train_seconds,
            "eval": eval_seconds,
            "total": time.perf_counter() - t_start,
        },
        "step_ms": step_ms,
        "history": history,
        "versions": {**versions(), "optax": optax.__version__},
    }
    (out / "countdown_train_metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    tiny._plot(history, out / "countdown_train_loss.png", title="Countdown search reasoner")
    print(f"wrote {out} and {export_dir} ({size / 1e6:.1f} MB)", flush=True)
    return metrics


if __name__ == "__main__":
    main()
