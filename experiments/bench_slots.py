"""Slot refill against static batches: rows of long-tailed forced lengths, wall time, tokens.

The [T2-L] acceptance run. R rows (P prompts x n samples, random token prompts) get forced
lengths drawn log-uniformly from [--min-len, --max-len] (a long tail: median ~ the geometric
mean, a few rows near the maximum). Both paths generate every row to its forced length with
no stop token, on random weights of a real config (nothing is downloaded):

- static: today's batches of B rows (`rejax.decode.prefill` + `decode_loop` per batch, as
  `rejax.generate` runs them), each batch stepping until its longest row ends
  (max_new_tokens = the batch's longest forced length); every batch is compiled ahead of
  its timed run, so the wall time is execution only;
- slots: `rejax.slots.generate_rows` with B slots and the per-row budgets, after a warm-up run
  of the same shapes (so compilation is excluded here too).

Reported per quant: wall time of each path and their ratio, mean slot occupancy, generated
tokens/s (forced tokens only), the number of rows whose tokens are identical in both paths
(with the first differing step of the others), compile times, and versions. JSON goes to
--out (default experiments/results/bench_slots.json), rewritten after each quant.

    PYTHONPATH=. python experiments/bench_slots.py                 # H200: 512 rows, 64 slots
    PYTHONPATH=. python experiments/bench_slots.py --small --out /tmp/s.json   # CPU smoke
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from rejax import bench as rbench
from rejax import config as rconfig
from rejax import decode as rdecode
from rejax import params as rparams
from rejax import slots as rslots
from rejax.cache import init_cache
from rejax.generate import _bucket, _pad_batch, _row_keys
from rejax.sampling import Greedy, ReSET, sampler_init

SMALL = rconfig.Config(
    vocab_size=512,
    hidden_size=128,
    intermediate_size=256,
    num_layers=2,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    max_position_embeddings=4096,
)
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "bench_slots.json"


def random_params(cfg: rconfig.Config, seed: int = 0):
    """Random weights on the device; W4A4 linears get static activation scales."""
    params = rparams.random_params(cfg, seed)
    if cfg.quant == "nvfp4":
        scale = jnp.full((cfg.num_layers,), 4.0 / (6 * 448), jnp.float32)
        weights = rparams.map_linears(params.weights, lambda _, p: {**p, "input_scale": scale})
        params = dataclasses.replace(params, weights=weights)
    return params


def forced_lengths(rows: int, lo: int, hi: int, seed: int) -> np.ndarray:
    """[rows] int lengths, log-uniform on [lo, hi]."""
    rng = np.random.default_rng(seed)
    return np.minimum(hi, np.floor(lo * (hi / lo) ** rng.random(rows))).astype(np.int64)


def random_prompts(n_prompts: int, vocab: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed + 1)
    return [
        [int(t) for t in rng.integers(0, vocab, size=int(rng.integers(lo, hi + 1)))]
        for _ in range(n_prompts)
    ]


def make_sampler(name: str, vocab: int):
    if name == "greedy":
        return Greedy()
    nl = np.zeros((vocab,), bool)
    nl[[10, 11]] = True
    dnl = np.zeros((vocab,), bool)
    dnl[12] = True
    # tau_0 near random weights' entropy, so both temperatures are drawn
    return ReSET(
        t_low=0.3, t_high=1.0, tau_0=5.0, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl)
    )


def run_static(params, prompts, n, batch_rows, budgets, key, sampler, log):
    """Static batches of `batch_rows` rows, compiled ahead; returns (tokens per row, timings)."""
    if batch_rows % n:
        raise SystemExit(f"--slots {batch_rows} must be a multiple of --n {n} (static batches)")
    per_batch = batch_rows // n
    stop = jnp.zeros((params.cfg.vocab_size,), bool)
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    rows_out: list[np.ndarray] = []
    wall = compile_s = 0.0
    steps = 0
    for j in range(0, len(prompts), per_batch):
        batch = prompts[j : j + per_batch]
        expanded = [p for p in batch for _ in range(n)]
        first = j * n
        m = int(budgets[first : first + len(expanded)].max())
        bucket = _bucket(max(len(p) for p in expanded))
        tokens, positions, lengths, done = _pad_batch(expanded, batch_rows, bucket)
        args = (jnp.asarray(tokens), jnp.asarray(positions))
        keys = _row_keys(key, first, batch_rows)
        t0 = time.perf_counter()
        cache = init_cache(params.cfg, batch_rows, bucket + m, dtype)
        prefill = rdecode.prefill.lower(params, *args, cache).compile()
        logits_shape = jax.ShapeDtypeStruct((batch_rows, params.cfg.vocab_size), jnp.float32)
        loop = rdecode.decode_loop.lower(
            params,
            logits_shape,
            cache,
            jnp.asarray(lengths),
            sampler,
            sampler_init(sampler, batch_rows),
            keys,
            stop,
            jnp.asarray(done),
            max_new_tokens=m,
        ).compile()
        compile_s += time.perf_counter() - t0
        state = sampler_init(sampler, batch_rows)
        jax.block_until_ready((cache, state))
        t0 = time.perf_counter()
        logits, cache = prefill(params, *args, cache)
        out = loop(
            params,
            logits,
            cache,
            jnp.asarray(lengths),
            sampler,
            state,
            keys,
            stop,
            jnp.asarray(done),
        )
        toks = np.asarray(jax.device_get(out.tokens))
        wall += time.perf_counter() - t0
        steps += m
        for r in range(len(expanded)):
            rows_out.append(toks[r, : budgets[first + r]])
        log(f"  static batch {j // per_batch}: {m} steps, {wall:.1f}s so far")
        del out, cache
    return rows_out, {"wall_s": wall, "compile_s": compile_s, "steps": steps}


def run_slots(params, prompts, n, slots, budgets, key, sampler, refill_rows, max_steps, log):
    stop = jnp.zeros((params.cfg.vocab_size,), bool)
    m = int(budgets.max())
    kw = {
        "slots": slots,
        "sampler": sampler,
        "key": key,
        "stop_mask": stop,
        "refill_rows": refill_rows,
        "max_steps": max_steps,
        "buffer_tokens": m,
    }
    t0 = time.perf_counter()
    # Warm-up: the same B, M and prompt buckets, a few short rows (compiles every program).
    by_bucket = {}
    for p in prompts:
        by_bucket.setdefault(_bucket(len(p)), p)
    warm = list(by_bucket.values())
    rslots.generate_rows(params, warm, n=1, max_new_tokens=2, **kw)
    compile_s = time.perf_counter() - t0
    log(f"  slots warm-up (compile) {compile_s:.1f}s")
    memory = _chunk_memory(params, slots, max(by_bucket) + m, m, sampler, stop)
    log(f"  decode_chunk memory {memory}")
    done = [0]

    def progress(rows, _prompts, _tokens):
        done[0] += rows
        if done[0] % 64 < rows:
            log(f"  slots: {done[0]} rows done, {time.perf_counter() - t1:.1f}s")

    t1 = time.perf_counter()
    rows, stats = rslots.generate_rows(
        params, prompts, n=n, max_new_tokens=[int(b) for b in budgets], progress=progress, **kw
    )
    wall = time.perf_counter() - t1
    stats = {"wall_s": wall, "compile_s": compile_s, "memory": memory, **stats.as_dict()}
    return [r[0] for r in rows], stats


def _chunk_memory(params, slots, length, m, sampler, stop) -> dict:
    # The per-row cache writes are scatters: in place when the cache buffer is reused, a copy
    # of the whole cache per write otherwise (XLA:CPU does this for bf16, which it scatters in
    # float32). The compiled decode step's temporaries show which one this backend does.
    state = jax.eval_shape(lambda: rslots.init_slots(params, slots, length, m, sampler))
    one = jnp.int32(1)
    mem = rslots.decode_chunk.lower(params, state, sampler, stop, one, one).compile()
    mem = mem.memory_analysis()
    cache = 2 * int(np.prod(state.cache.k.shape)) * state.cache.k.dtype.itemsize
    temp = None if mem is None else int(mem.temp_size_in_bytes)
    return {
        "cache_bytes": cache,
        "decode_chunk_temp_bytes": temp,
        # judged only where the cache dwarfs the step's other temporaries (logits, sampler)
        "cache_copied": None if temp is None or cache < 1 << 30 else temp >= cache,
    }


def compare(static_rows, slot_rows) -> dict:
    same, first_diff = 0, []
    for a, b in zip(static_rows, slot_rows):
        if len(a) == len(b) and np.array_equal(a, b):
            same += 1
        else:
            k = min(len(a), len(b))
            diff = np.nonzero(a[:k] != b[:k])[0]
            first_diff.append(int(diff[0]) if len(diff) else k)
    return {
        "rows": len(static_rows),
        "rows_identical": same,
        "all_identical": same == len(static_rows),
        "first_differing_step": first_diff[:32],
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override num_layers")
    ap.add_argument("--attention", default="einsum", choices=rconfig.ATTENTIONS)
    ap.add_argument("--quant", nargs="+", default=["nvfp4", "bf16"], choices=["bf16", "nvfp4"])
    ap.add_argument("--prompts", type=int, default=64, help="P prompts (rows = P x n)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--slots", type=int, default=64, help="B slots = static batch rows")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    ap.add_argument("--sampler", default="reset", choices=["reset", "greedy"])
    ap.add_argument("--refill-rows", type=int, default=None, help="rows per slot prefill")
    ap.add_argument("--max-steps", type=int, default=256, help="decode steps per host sync")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--small", action="store_true", help="tiny config and rows (CPU smoke)")
    ap.add_argument("--out", default=str(DEFAULT_OUT), help="JSON results path")
    args = ap.parse_args(argv)
    cfg = rconfig.PRESETS[args.preset]
    if args.small:
        cfg = SMALL
        args.prompts, args.n, args.slots = min(args.prompts, 6), min(args.n, 2), min(args.slots, 4)
        args.min_len, args.max_len = min(args.min_len, 4), min(args.max_len, 48)
        args.prompt_len = [3, 20]
    if args.layers is not None:
        cfg = dataclasses.replace(cfg, num_layers=args.layers)
    cfg = dataclasses.replace(cfg, attention=args.attention)

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = args.prompts * args.n
    budgets = forced_lengths(rows, args.min_len, args.max_len, args.seed)
    prompts = random_prompts(args.prompts, cfg.vocab_size, *args.prompt_len, args.seed)
    sampler = make_sampler(args.sampler, cfg.vocab_size)
    key = jax.random.key(args.seed)
    result = {
        "args": vars(args),
        "config": dataclasses.asdict(cfg),
        "versions": rbench.versions(),
        "rows": rows,
        "forced_lengths": {
            "min": int(budgets.min()),
            "median": float(np.median(budgets)),
            "mean": float(budgets.mean()),
            "max": int(budgets.max()),
            "total": int(budgets.sum()),
        },
        "runs": [],
    }
    log(f"{rows} rows, forced lengths {result['forced_lengths']}")
    for quant in args.quant:
        qcfg = dataclasses.replace(cfg, quant=None if quant == "bf16" else quant)
        params = random_params(qcfg, args.seed)
        jax.block_until_ready(params.weights)
        log(f"[{quant}] static batches of {args.slots} rows")
        s_rows, s_t = run_static(params, prompts, args.n, args.slots, budgets, key, sampler, log)
        log(f"[{quant}] {args.slots} slots")
        r_rows, r_t = run_slots(
            params,
            prompts,
            args.n,
            args.slots,
            budgets,
            key,
            sampler,
            args.refill_rows,
            args.max_steps,
            log,
        )
        total = int(budgets.sum())
        run = {
            "quant": quant,
            "static": {**s_t, "tokens_per_s": total / s_t["wall_s"]},
            "slots": {**r_t, "tokens_per_s": total / r_t["wall_s"]},
            "wall_ratio_slots_over_static": r_t["wall_s"] / s_t["wall_s"],
            # the fewest steps B slots could take (every slot busy every step)
            "ideal_slot_steps": total / args.slots,
            "tokens": compare(s_rows, r_rows),
        }
        result["runs"].append(run)
        log(
            f"[{quant}] static {s_t['wall_s']:.1f}s, slots {r_t['wall_s']:.1f}s "
            f"(x{run['wall_ratio_slots_over_static']:.2f}), occupancy {r_t['occupancy']:.3f} "
            f"({r_t['occupancy_while_pending'] or 0:.3f} while rows pending), "
            f"{run['slots']['tokens_per_s']:.0f} vs {run['static']['tokens_per_s']:.0f} tok/s, "
            f"identical rows {run['tokens']['rows_identical']}/{rows}"
        )
        del params
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    main()
