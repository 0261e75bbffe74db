"""Slot refill against static batches: rows of long-tailed forced lengths, wall time, tokens.

The [T2-L] acceptance run. R rows (P prompts x n samples, random token prompts) get forced
lengths drawn log-uniformly from [--min-len, --max-len] (a long tail: median ~ the geometric
mean, a few rows near the maximum). Three paths generate every row to its forced length with
no stop token, on random weights of a real config (nothing is downloaded):

- static: today's batches of B rows (a prefill + `decode_loop` per batch, as `rejax.generate`
  runs them with max_new_tokens = the longest forced length M, and with
  `prefill_rows=--refill-rows` unless `--static-prefill one`: the prompts prefilled in chunks
  with the slot refills' shapes, which a GPU needs for the same tokens), each batch
  stepping until its longest row ends (the loop's traced step limit stands in for the stop
  token that would end it); the loop and prefill are compiled ahead (one per prompt bucket),
  so the wall time is execution only;
- refill: `rejax.slots.generate_rows` with B slots and the per-row budgets, compact=False (the
  drain runs in the B-row program);
- compact: the same with compaction (the default): once nothing is pending, the live rows move
  into programs of B/2, B/4, ... 1 rows (or the sizes of --compact-sizes).
Both slot paths run after one warm-up of the same shapes (B rows of budgets 1..B, so the
drain compiles every program size), so compilation is excluded there too.

Reported per quant: wall time of each path and the ratio to static, occupancy (per step:
live rows / rows of the program that ran; averaged over steps, weighted by rows, and by
measured decode time), decode steps per program size (with the step counts a host-side model
of the schedule predicts, which must match), generated tokens/s (forced tokens only), whether
every row's tokens are identical to static (with the first differing steps otherwise),
compile times and versions. JSON goes to --out (default experiments/results/bench_slots.json),
rewritten after each quant; the script exits with status 1 if any row differs.

Every path uses the buffer and cache room M = --max-len (x --len-scale), as `rejax.generate`
with max_new_tokens = M, so all programs compile before any length is drawn. --time-budget S
bounds one quant's run: after the compiles, the decode step is timed at B and 1 rows, the
step model predicts the three paths' execution, and the drawn lengths (--min-len, --max-len)
are scaled down together (the same long-tailed shape, M unchanged) until it fits what is left
of S; the JSON records the scale and the prediction next to the measured times. The first
quant fixes the lengths for the others.

    PYTHONPATH=. python experiments/bench_slots.py --preset qwen3-8b --layers 4 --quant nvfp4
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
from rejax.decoder import logits_out_dtype
from rejax.generate import _bucket, _pad_batch, _row_keys, prefill_chunked
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


def _static_batches(prompts, n, batch_rows):
    per_batch = batch_rows // n
    for j in range(0, len(prompts), per_batch):
        expanded = [p for p in prompts[j : j + per_batch] for _ in range(n)]
        yield j * n, expanded, _bucket(max(len(p) for p in expanded))


def _static_cache(params, batch_rows, length, chunked):
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    cache = init_cache(params.cfg, batch_rows, length, dtype)
    # the chunked prefill leaves a per-row write index (each row at its own bucket)
    return (
        dataclasses.replace(cache, index=jnp.zeros((batch_rows,), jnp.int32)) if chunked else cache
    )


def compile_static(
    params, prompts, n, batch_rows, m, key, sampler, prefill_rows=None
) -> tuple[dict, float]:
    """Static batches' programs, compiled ahead: {prompt bucket: (prefill, decode loop)} for
    batches of `batch_rows` rows over a cache of bucket + M (`rejax.generate` with
    max_new_tokens = M), and the seconds spent. The loop's step limit is traced. With
    `prefill_rows` the prefill is `prefill_chunked` (its chunk programs compile on a first
    run of each bucket's first batch here)."""
    if batch_rows % n:
        raise SystemExit(f"--slots {batch_rows} must be a multiple of --n {n} (static batches)")
    stop = jnp.zeros((params.cfg.vocab_size,), bool)
    chunked = prefill_rows is not None
    compiled = {}
    t0 = time.perf_counter()
    for first, expanded, bucket in _static_batches(prompts, n, batch_rows):
        if bucket in compiled:
            continue
        tokens, positions, lengths, done = _pad_batch(expanded, batch_rows, bucket)
        cache = jax.eval_shape(lambda b=bucket: _static_cache(params, batch_rows, b + m, chunked))
        if chunked:
            fresh = _static_cache(params, batch_rows, bucket + m, False)
            jax.block_until_ready(prefill_chunked(params, expanded, fresh, prefill_rows))
            del fresh

            def prefill(params_, expanded_, cache_):
                return prefill_chunked(params_, expanded_, cache_, prefill_rows)
        else:
            # the head's logits, as rejax.generate prefills them
            one = rdecode.prefill.lower(
                params, tokens, positions, cache, logits_dtype=None
            ).compile()

            def prefill(params_, expanded_, cache_, one=one, b=bucket):
                t, q, _, _ = _pad_batch(expanded_, batch_rows, b)
                return one(params_, jnp.asarray(t), jnp.asarray(q), cache_)

        head = logits_out_dtype(params.weights["embed_tokens"]["embedding"].dtype, None)
        logits_shape = jax.ShapeDtypeStruct((batch_rows, params.cfg.vocab_size), head)
        loop = rdecode.decode_loop.lower(
            params,
            logits_shape,
            cache,
            jnp.asarray(lengths),
            sampler,
            sampler_init(sampler, batch_rows),
            _row_keys(key, first, batch_rows),
            stop,
            jnp.asarray(done),
            max_new_tokens=m,
            steps=jnp.int32(1),
        ).compile()
        compiled[bucket] = prefill, loop
    return compiled, time.perf_counter() - t0


def run_static(params, prompts, n, batch_rows, budgets, m, key, sampler, compiled, log):
    """Static batches of `batch_rows` rows, as `rejax.generate` runs them with max_new_tokens =
    M (a cache of bucket + M), each batch stepping until its longest row ends (the loop's
    traced step limit stands in for the stop token that would end it). Returns (tokens per
    row, timings)."""
    stop = jnp.zeros((params.cfg.vocab_size,), bool)
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    rows_out: list[np.ndarray] = []
    wall, steps = 0.0, 0
    for first, expanded, bucket in _static_batches(prompts, n, batch_rows):
        longest = jnp.int32(budgets[first : first + len(expanded)].max())
        _, _, lengths, done = _pad_batch(expanded, batch_rows, bucket)
        keys = _row_keys(key, first, batch_rows)
        cache = init_cache(params.cfg, batch_rows, bucket + m, dtype)
        state = sampler_init(sampler, batch_rows)
        prefill, loop = compiled[bucket]
        jax.block_until_ready((cache, state, keys))
        t0 = time.perf_counter()
        logits, cache = prefill(params, expanded, cache)
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
            steps=longest,
        )
        toks, ran = jax.device_get((out.tokens, out.step))
        wall += time.perf_counter() - t0
        steps += int(ran)
        for r in range(len(expanded)):
            rows_out.append(np.asarray(toks[r, : budgets[first + r]]))
        log(f"  static batch {first // batch_rows}: {int(ran)} steps, {wall:.1f}s so far")
        del out, cache
    return rows_out, {"wall_s": wall, "steps": steps}


def warm_up(params, prompts, slots, m, kw, log) -> float:
    """Compiles every slot program of the run: prefill per prompt bucket at B, and per program
    size the decode step, the row gather and the compaction (B rows of budgets 1..B drain
    through every size). Returns seconds."""
    by_bucket = {}
    for p in prompts:
        by_bucket.setdefault(_bucket(len(p)), p)
    warm = [list(by_bucket.values())[i % len(by_bucket)] for i in range(slots)]
    t0 = time.perf_counter()
    rslots.generate_rows(
        params, warm, n=1, max_new_tokens=[min(i + 1, m) for i in range(slots)], **kw
    )
    return time.perf_counter() - t0


def run_slots(params, prompts, n, budgets, kw, compact, log):
    """One timed slot run (after `warm_up`); returns (tokens per row, stats)."""
    done = [0]
    t1 = time.perf_counter()

    def progress(rows, _prompts, _tokens):
        done[0] += rows
        if done[0] % 64 < rows:
            log(f"  {done[0]} rows done, {time.perf_counter() - t1:.1f}s")

    rows, stats = rslots.generate_rows(
        params,
        prompts,
        n=n,
        max_new_tokens=[int(b) for b in budgets],
        progress=progress,
        compact=compact,
        **kw,
    )
    wall = time.perf_counter() - t1
    return [r[0] for r in rows], {"wall_s": wall, **stats.as_dict()}


def schedule(budgets, slots, refill_rows, max_steps, sizes) -> dict[int, int]:
    """Decode steps per program size that `rejax.slots.generate_rows` takes for rows of forced
    lengths (no stop token), by the same rules on the host: {size: steps}."""
    pending = [int(b) for b in budgets][::-1]
    left = []  # remaining steps of the live rows
    size, steps = slots, dict.fromkeys(sizes, 0)
    while True:
        while pending and len(left) < size:
            left.append(pending.pop())
        if not left:
            return {c: k for c, k in steps.items() if k}
        smaller = [c for c in sizes if c < size]
        while not pending and smaller and len(left) <= smaller[0]:
            size, smaller = smaller[0], smaller[1:]
        if pending:
            want = min(refill_rows, len(pending))
        else:
            want = size - smaller[0] if smaller else size
        need = want - (size - len(left))  # rows that must end (>= 1 here)
        k = min(max_steps, sorted(left)[need - 1])
        steps[size] += k
        left = [r - k for r in left if r > k]


def step_model(params, slots, length, m, sampler, stop, steps=16) -> dict:
    """Seconds per decode step at B and 1 rows on the run's cache of `length` slots, timed on
    the run's own `decode_chunk` programs (compiled by `warm_up`): {rows: seconds}."""
    out = {}
    for b in sorted({slots, 1}, reverse=True):
        state = rslots.init_slots(params, b, length, m, sampler)
        state = dataclasses.replace(
            state, done=jnp.zeros((b,), bool), budget=jnp.full((b,), m, jnp.int32)
        )
        want = jnp.int32(b)  # jnp scalars, as the driver passes them: the same program
        state, _, _ = rslots.decode_chunk(params, state, sampler, stop, want, jnp.int32(1))
        jax.block_until_ready(state)
        t0 = time.perf_counter()
        state, ran, _ = rslots.decode_chunk(params, state, sampler, stop, want, jnp.int32(steps))
        jax.block_until_ready(state)
        out[b] = (time.perf_counter() - t0) / int(ran)
        del state
    return out


def _step_s(model: dict, b: int, slots: int) -> float:
    # linear in rows between the probed 1 and B (the weights are read once per step either way)
    lo, hi = model[1], model[slots]
    return lo + (hi - lo) * (b - 1) / max(1, slots - 1)


def predict(budgets, n, slots, refill_rows, max_steps, model, compact=True) -> dict:
    """Predicted execution seconds of the three paths, and their step counts (`compact`: the
    compact path's sizes, as `rejax.slots.compact_sizes` takes them)."""
    per_batch = slots // n
    static_steps = sum(
        int(budgets[j * n : (j + per_batch) * n].max())
        for j in range(0, len(budgets) // n, per_batch)
    )
    out = {"static": {"steps_by_size": {slots: static_steps}}}
    for name, how in (("refill", False), ("compact", compact)):
        sizes = rslots.compact_sizes(slots, how)
        out[name] = {"steps_by_size": schedule(budgets, slots, refill_rows, max_steps, sizes)}
    for v in out.values():
        v["exec_s"] = sum(k * _step_s(model, c, slots) for c, k in v["steps_by_size"].items())
    return out


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


def _budgets(args, scale):
    lo = max(1, round(args.min_len * scale))
    hi = max(lo, round(args.max_len * scale))
    return forced_lengths(args.prompts * args.n, lo, hi, args.seed), (lo, hi)


def _summary(budgets) -> dict:
    return {
        "min": int(budgets.min()),
        "median": float(np.median(budgets)),
        "mean": float(budgets.mean()),
        "max": int(budgets.max()),
        "total": int(budgets.sum()),
    }


def _compact(args):
    return list(args.compact_sizes) if args.compact_sizes else "auto"


def choose_scale(args, model, refill_rows, spent_s, log) -> tuple[float, dict]:
    """The largest length scale (--len-scale, or smaller) whose predicted execution fits what
    --time-budget leaves after `spent_s` (the compiles)."""
    scale, left = args.len_scale, args.time_budget - spent_s
    while True:
        budgets, _ = _budgets(args, scale)
        pred = predict(
            budgets, args.n, args.slots, refill_rows, args.max_steps, model, _compact(args)
        )
        # plus the slot prefills and host syncs, a few percent (not modelled)
        exec_s = sum(v["exec_s"] for v in pred.values())
        if exec_s <= left or scale <= args.len_scale / 256:
            break
        scale = round(scale * 0.9, 5)
    log(
        f"  time budget {args.time_budget}s, {spent_s:.0f}s spent compiling: length scale "
        f"{scale}, predicted execution {exec_s:.0f}s"
    )
    info = {
        "time_budget_s": args.time_budget,
        "compile_s_before_choice": spent_s,
        "step_s": model,
        "predicted_exec_s": exec_s,
        "predicted": pred,
    }
    return scale, info


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen3-8b", choices=sorted(rconfig.PRESETS))
    ap.add_argument("--layers", type=int, default=None, help="override num_layers")
    ap.add_argument("--attention", default="live", choices=rconfig.ATTENTIONS)
    ap.add_argument("--quant", nargs="+", default=["nvfp4", "bf16"], choices=["bf16", "nvfp4"])
    ap.add_argument("--prompts", type=int, default=64, help="P prompts (rows = P x n)")
    ap.add_argument("--n", type=int, default=8, help="samples per prompt")
    ap.add_argument("--slots", type=int, default=64, help="B slots = static batch rows")
    ap.add_argument("--min-len", type=int, default=256)
    ap.add_argument("--max-len", type=int, default=8192)
    ap.add_argument("--len-scale", type=float, default=1.0, help="multiply --min-len and --max-len")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=None,
        metavar="S",
        help="scale the lengths down from --len-scale so that one quant's predicted run "
        "(compiles included) takes at most S seconds",
    )
    ap.add_argument("--prompt-len", type=int, nargs=2, default=[16, 64], metavar=("LO", "HI"))
    ap.add_argument("--sampler", default="reset", choices=["reset", "greedy"])
    ap.add_argument("--refill-rows", type=int, default=None, help="rows per slot prefill")
    ap.add_argument(
        "--static-prefill",
        default="chunked",
        choices=["chunked", "one"],
        help="static batches' prefill: in chunks of --refill-rows prompts, the slot refills' "
        "shapes (default), or one prefill per batch",
    )
    ap.add_argument(
        "--compact-sizes",
        type=int,
        nargs="+",
        default=None,
        help="program sizes below --slots for the compact path (default: 'auto', the powers of two "
        "down to 16); "
        "e.g. 32 16 keeps the drain at row counts whose kernels may round as B rows do",
    )
    ap.add_argument(
        "--invariant-rows",
        type=int,
        default=None,
        help="Config.invariant_rows for every path (e.g. --slots: the NVFP4 GEMM splits K as "
        "for that many rows at any row count)",
    )
    ap.add_argument("--max-steps", type=int, default=256, help="decode steps per host sync")
    ap.add_argument(
        "--xla-autotune",
        choices=["on", "off"],
        default="off",
        help="Config.xla_autotune for every path (default off: on a GPU 'auto' compaction "
        "needs it off, see rejax.slots.auto_compacts)",
    )
    ap.add_argument(
        "--paths",
        nargs="+",
        default=["refill", "compact"],
        choices=["refill", "compact"],
        help="slot paths to run against the static batches (default: both)",
    )
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
    cfg = dataclasses.replace(
        cfg,
        attention=args.attention,
        invariant_rows=args.invariant_rows,
        xla_autotune=args.xla_autotune == "on",
    )
    if args.slots % args.n:
        raise SystemExit(
            f"--slots {args.slots} must be a multiple of --n {args.n} (static batches)"
        )
    try:
        rslots.compact_sizes(args.slots, _compact(args))
    except ValueError as err:
        raise SystemExit(f"--compact-sizes: {err}") from None

    def log(msg):
        print(msg, file=sys.stderr, flush=True)

    rows = args.prompts * args.n
    prompts = random_prompts(args.prompts, cfg.vocab_size, *args.prompt_len, args.seed)
    sampler = make_sampler(args.sampler, cfg.vocab_size)
    stop = jnp.zeros((cfg.vocab_size,), bool)
    refill_rows = args.refill_rows or rslots._default_refill_rows(args.slots)
    key = jax.random.key(args.seed)
    result = {
        "args": vars(args),
        "config": dataclasses.asdict(cfg),
        "versions": rbench.versions(),
        "rows": rows,
        "runs": [],
    }
    # M, the buffer and cache room of every path, is fixed by --max-len (and --len-scale)
    # before --time-budget may shrink the drawn lengths, so every program compiles first.
    m = max(1, round(args.max_len * args.len_scale))
    scale, budgets = args.len_scale, None
    for quant in args.quant:
        qcfg = dataclasses.replace(cfg, quant=None if quant == "bf16" else quant)
        params = random_params(qcfg, args.seed)
        jax.block_until_ready(params.weights)
        t_quant = time.perf_counter()
        compiled, static_compile_s = compile_static(
            params,
            prompts,
            args.n,
            args.slots,
            m,
            key,
            sampler,
            refill_rows if args.static_prefill == "chunked" else None,
        )
        log(f"[{quant}] static programs compiled in {static_compile_s:.1f}s")
        kw = {
            "slots": args.slots,
            "sampler": sampler,
            "key": key,
            "stop_mask": stop,
            "refill_rows": refill_rows,
            "max_steps": args.max_steps,
            "buffer_tokens": m,
        }
        compile_s = warm_up(params, prompts, args.slots, m, kw, log)
        log(f"[{quant}] slot programs compiled in {compile_s:.1f}s")
        length = max(_bucket(len(p)) for p in prompts) + m
        memory = _chunk_memory(params, args.slots, length, m, sampler, stop)
        budget_info = None
        if budgets is None:  # the first quant fixes the lengths for all
            if args.time_budget is not None:
                model = step_model(params, args.slots, length, m, sampler, stop)
                spent = time.perf_counter() - t_quant
                scale, budget_info = choose_scale(args, model, refill_rows, spent, log)
            budgets, (lo, hi) = _budgets(args, scale)
            result.update(length_scale=scale, lengths=[lo, hi], forced_lengths=_summary(budgets))
            log(f"{rows} rows, forced lengths {result['forced_lengths']}, buffer M = {m}")
        log(f"[{quant}] static batches of {args.slots} rows")
        s_rows, s_t = run_static(
            params, prompts, args.n, args.slots, budgets, m, key, sampler, compiled, log
        )
        s_t["compile_s"] = static_compile_s
        total = int(budgets.sum())
        run = {
            "quant": quant,
            "static": {**s_t, "tokens_per_s": total / s_t["wall_s"]},
            "slots_compile_s": compile_s,
            "decode_chunk_memory": memory,
            # the fewest steps B slots could take (every slot busy every step)
            "ideal_slot_steps": total / args.slots,
        }
        if budget_info is not None:
            run["time_budget"] = budget_info
        for name, compact in (("refill", False), ("compact", _compact(args))):
            if name not in args.paths:
                continue
            log(f"[{quant}] {args.slots} slots, {name}")
            r_rows, r_t = run_slots(params, prompts, args.n, budgets, kw, compact, log)
            sizes = rslots.compact_sizes(args.slots, compact)
            model = schedule(budgets, args.slots, refill_rows, args.max_steps, sizes)
            run[name] = {
                **r_t,
                "tokens_per_s": total / r_t["wall_s"],
                "wall_ratio_vs_static": r_t["wall_s"] / s_t["wall_s"],
                "modelled_steps_by_size": model,
                "vs_static": compare(s_rows, r_rows),
            }
            log(
                f"[{quant}] {name}: {r_t['wall_s']:.1f}s (x{run[name]['wall_ratio_vs_static']:.2f}"
                f" of static {s_t['wall_s']:.1f}s), occupancy {r_t['occupancy']:.3f} (rows "
                f"{r_t['row_occupancy']:.3f}, time {r_t['time_weighted_occupancy']:.3f}; "
                f"{r_t['occupancy_while_pending'] or 0:.3f} while rows pending), steps by size "
                f"{r_t['steps_by_size']}, {run[name]['tokens_per_s']:.0f} vs "
                f"{run['static']['tokens_per_s']:.0f} tok/s, identical rows "
                f"{run[name]['vs_static']['rows_identical']}/{rows}"
            )
        run["quant_total_s"] = time.perf_counter() - t_quant
        log(f"[{quant}] done in {run['quant_total_s']:.0f}s (compiles included)")
        if budget_info is not None:
            log(f"  (--time-budget {args.time_budget}s; measured {run['quant_total_s']:.0f}s)")
        result["runs"].append(run)
        del params
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2, default=str) + "\n")
    return result


if __name__ == "__main__":
    res = main()
    diff = {
        f"{r['quant']} {name}": r[name]["vs_static"]["rows"]
        - r[name]["vs_static"]["rows_identical"]
        for r in res["runs"]
        for name in ("refill", "compact")
        if name in r
    }
    bad = [f"{k}: {v}" for k, v in diff.items() if v]
    if bad:
        sys.exit(f"rows whose tokens differ from static batches: {', '.join(bad)}")
