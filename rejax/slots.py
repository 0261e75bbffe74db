"""Slot-refill generation: a fixed number of row slots kept busy over many (prompt, sample) rows.

Static batches (rejax/generate.py) step every row until the batch's longest row ends. Here B
slots decode together and a slot whose row ends takes the next pending row: that row's prompt
is prefilled on its own (a [P, T] prefill into a fresh cache) and copied into the slot's cache
row, while the other slots keep their state. The cache has a per-row write index [B]
(rejax/cache.py), so every slot runs at its own position; each slot's cache row holds its
prompt left-padded to the prompt's bucket at slots [0, T) and its generated tokens after it,
the layout of a static batch row, and the slot positions mask whatever a previous occupant left.

A few jitted programs serve a whole run: `decode_chunk` (one `lax.while_loop` of decode steps
that stops once `want` slots are free, after `max_steps` steps, or when every slot is done) and
`slot_prefill` (one per prompt bucket; P rows at a time, padded with dummy rows). The host
loop between them reads the done mask, collects the finished rows (a jitted gather of P rows
at a time, so only they cross to the host) and refills their slots.

Once no row is pending, slots drain: without more, the last long rows would run alone in a
B-row program. With compaction (the default) the host instead gathers the live rows into a
program of the next smaller size (B/2, B/4, ... 1 by default; `compact_slots`) as soon as they
fit, and decodes on with that size's `decode_chunk`. So the compiled programs are one
`decode_chunk`, one `compact_slots` and one row gather per program size, and one `slot_prefill`
per prompt bucket (refills only happen at B, while rows are pending).

A row's tokens depend only on its prompt, its budget, the key and its row index r: row r samples
its step i with fold_in(fold_in(key, r), i), the rule of `rejax.generate`, so a refilled run
gives the tokens of static batches. Dimension letters: see rejax/config.py (B slots, P rows
prefilled together, T prompt bucket, S cache slots, V vocab, M the largest budget).
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rejax.cache import KVCache, init_cache
from rejax.decode import TRACE_COUNTS, per_compiler_options
from rejax.decoder import forward, logits_out_dtype
from rejax.params import Params
from rejax.sampling import broadcast_rows, sample, sampler_init


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SlotState:
    """Device state of B slots, carried through `decode_chunk` and `slot_prefill`.

    Attributes:
        logits: [B, V] logits for each slot's next token, in the head's dtype (bfloat16 for a
            bfloat16 model, read by the sampler as their float32 values).
        cache: KVCache with a per-row index [B] (the next slot each row writes).
        positions: [B] int32 position of each slot's next token.
        step: [B] int32 tokens the slot's row has generated (its next step index).
        budget: [B] int32 tokens the slot's row may generate at most.
        keys: [B] the rows' PRNG keys fold_in(key, r).
        sampler_state: the sampler's SamplerState, one row per slot.
        done: [B] bool slots whose row ended (or that never held one): free to refill.
        stopped: [B] bool rows that ended on a stop token.
        tokens, entropy, temperature: [B, M] output buffers, column i = step i.
    """

    logits: jax.Array
    cache: KVCache
    positions: jax.Array
    step: jax.Array
    budget: jax.Array
    keys: jax.Array
    sampler_state: Any
    done: jax.Array
    stopped: jax.Array
    tokens: jax.Array
    entropy: jax.Array
    temperature: jax.Array


def init_slots(params: Params, slots: int, length: int, max_new_tokens: int, sampler) -> SlotState:
    """B empty slots (every one done) over a cache of S = `length` slots per row.

    Args:
        params: the model (its embedding dtype is the cache dtype).
        slots: B.
        length: S, at least the largest prompt bucket plus the largest budget.
        max_new_tokens: M, the output buffer width (the largest budget).
        sampler: the run's sampler (its state's shape).
    """
    cfg = params.cfg
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    cache = init_cache(cfg, slots, length, dtype)
    cache = dataclasses.replace(cache, index=jnp.zeros((slots,), jnp.int32))
    zi = jnp.zeros((slots,), jnp.int32)
    state = SlotState(
        logits=jnp.zeros((slots, cfg.vocab_size), logits_out_dtype(dtype, None)),
        cache=cache,
        positions=zi,
        step=zi,
        budget=zi,
        keys=jax.random.split(jax.random.key(0), slots),
        sampler_state=sampler_init(sampler, slots),
        done=jnp.ones((slots,), bool),
        stopped=jnp.zeros((slots,), bool),
        tokens=jnp.zeros((slots, max_new_tokens), jnp.int32),
        entropy=jnp.zeros((slots, max_new_tokens), jnp.float32),
        temperature=jnp.zeros((slots, max_new_tokens), jnp.float32),
    )
    # distinct buffers: the state is donated, and one buffer may not be donated twice
    return jax.tree.map(jnp.copy, state)


def prefill_rows(
    params: Params, cache: KVCache, tokens: jax.Array, positions: jax.Array, ids: jax.Array
) -> tuple[jax.Array, KVCache]:
    """Prefills P prompts into a fresh [P, T] cache and copies it into rows `ids` of `cache`.

    The one prefill of a slot refill and of a static batch's chunked prefill
    (`rejax.generate(..., prefill_rows=P)`): a row's prefill arithmetic depends on its prompt
    and the shape [P, T] alone, not on the rows beside it or the cache it lands in.

    Args:
        params: the model.
        cache: the [B]-row cache with a per-row write index [B] (traced; not donated here).
        tokens: [P, T] int32 prompts left-padded to their bucket T.
        positions: [P, T] int32 positions (-1 = padding).
        ids: [P] int32 cache row of each prompt; B (out of range) for a dummy row, dropped.

    Returns:
        (logits [P, V] at each prompt's last token in the head's dtype, the cache with each
        row's slots [0, T) from the prompt, its slot positions, and its write index T).
    """
    cfg = params.cfg
    p, t = tokens.shape
    s = cache.length
    fresh = init_cache(cfg, p, t, params.weights["embed_tokens"]["embedding"].dtype)
    logits, fresh = forward(
        params.weights, tokens, positions, fresh, cfg, jnp.argmax(positions, axis=1),
        logits_dtype=None,
    )  # fmt: skip

    def put(buf, rows):  # rows past B (dummies) are dropped
        return buf.at[ids].set(rows.astype(buf.dtype), mode="drop")

    def put_rows(stack, rows):  # [L, B, S, ...] <- [L, P, T, ...] (fp8 scales alike)
        return None if stack is None else stack.at[:, ids, :t].set(rows, mode="drop")

    pos_rows = jnp.full((p, s), -1, jnp.int32).at[:, :t].set(positions)
    cache = KVCache(
        k=put_rows(cache.k, fresh.k),
        v=put_rows(cache.v, fresh.v),
        positions=put(cache.positions, pos_rows),
        index=put(cache.index, jnp.full((p,), t, jnp.int32)),
        k_scale=put_rows(cache.k_scale, fresh.k_scale),
        v_scale=put_rows(cache.v_scale, fresh.v_scale),
    )
    return logits, cache


@per_compiler_options(donate_argnames=("state",))
def slot_prefill(
    params: Params,
    state: SlotState,
    tokens: jax.Array,
    positions: jax.Array,
    slot_ids: jax.Array,
    key: jax.Array,
    rows: jax.Array,
    budgets: jax.Array,
    sampler,
) -> SlotState:
    """Prefills P prompts and puts each into its slot; the other slots keep their state.

    Args:
        params: the model.
        state: the slots (donated).
        tokens: [P, T] int32 prompts left-padded to their bucket T.
        positions: [P, T] int32 positions (-1 = padding).
        slot_ids: [P] int32 slot of each prompt; B (out of range) for a dummy row.
        key: the run's PRNG key.
        rows: [P] uint32 row index r of each prompt (its key is fold_in(key, r)).
        budgets: [P] int32 tokens each row may generate (<= M, and T + budget <= S).
        sampler: the run's sampler (its cleared state is put into the slots).

    Returns:
        The SlotState with the P rows live at step 0.
    """
    TRACE_COUNTS["slot_prefill"] += 1
    p = tokens.shape[0]
    ids = slot_ids.astype(jnp.int32)
    logits, cache = prefill_rows(params, state.cache, tokens, positions, ids)
    keys = jax.vmap(jax.random.fold_in, in_axes=(None, 0))(key, rows)

    def put(buf, rows):  # rows past B (dummies) are dropped
        return buf.at[ids].set(rows.astype(buf.dtype), mode="drop")

    cleared = sampler_init(sampler, p)
    return SlotState(
        logits=put(state.logits, logits),
        cache=cache,
        positions=put(state.positions, jnp.max(positions, axis=1) + 1),
        step=put(state.step, jnp.zeros((p,), jnp.int32)),
        budget=put(state.budget, budgets),
        keys=state.keys.at[ids].set(keys, mode="drop"),
        sampler_state=jax.tree.map(put, state.sampler_state, cleared),
        done=put(state.done, jnp.zeros((p,), bool)),
        stopped=put(state.stopped, jnp.zeros((p,), bool)),
        tokens=state.tokens,
        entropy=state.entropy,
        temperature=state.temperature,
    )


@per_compiler_options(donate_argnames=("state",))
def decode_chunk(
    params: Params,
    state: SlotState,
    sampler,
    stop_mask: jax.Array,
    want: jax.Array,
    max_steps: jax.Array,
) -> tuple[SlotState, jax.Array, jax.Array]:
    """Decode steps over all slots until `want` slots are done, or `max_steps`, or all done.

    Each live slot samples its step `step[b]` with fold_in(keys[b], step[b]) and feeds the
    token through the model at its own cache index; a row ends on a stop token or at its
    budget. Done slots keep stepping (fixed shapes) without advancing or recording anything.

    Args:
        params: the model.
        state: the slots (donated).
        sampler: Greedy | Temperature | ReSET.
        stop_mask: [V] bool stop token ids.
        want: [] int32 stop once this many slots are done (B: run until all are).
        max_steps: [] int32 steps at most in this call.

    Returns:
        (state, steps run [] int32, live row-steps [] int32 (occupancy numerator)).
    """
    TRACE_COUNTS["decode_chunk"] += 1
    b, m = state.tokens.shape
    sampler = broadcast_rows(sampler, b)  # once, not every step (sampling.broadcast_rows)
    rows = jnp.arange(b)

    def cond(c):
        s, n, _ = c
        free = jnp.sum(s.done.astype(jnp.int32))
        return (n < max_steps) & (free < want) & (free < b)

    def body(c):
        s, n, used = c
        # fold_in(keys[b], step[b]) (the grid sampler kernels fold it in their launch)
        tokens, sampler_state, info = sample(s.keys, s.logits, s.sampler_state, sampler,
                                             step=s.step)  # fmt: skip
        tokens = tokens.astype(jnp.int32)
        logits, cache = forward(
            params.weights, tokens[:, None], s.positions[:, None], s.cache, params.cfg,
            logits_dtype=None,
        )  # fmt: skip
        live = ~s.done
        col = jnp.where(live, s.step, m)  # column m is out of range: dropped

        def put(buf, x):
            return buf.at[rows, col].set(x.astype(buf.dtype), mode="drop")

        hit = live & stop_mask[tokens]
        step = jnp.where(live, s.step + 1, s.step)
        adv = live.astype(jnp.int32)
        s = SlotState(
            logits=logits[:, 0],
            cache=dataclasses.replace(cache, index=s.cache.index + adv),
            positions=s.positions + adv,
            step=step,
            budget=s.budget,
            keys=s.keys,
            sampler_state=sampler_state,
            done=s.done | hit | (step >= s.budget),
            stopped=s.stopped | hit,
            tokens=put(s.tokens, tokens),
            entropy=put(s.entropy, info["entropy"]),
            temperature=put(s.temperature, info["temperature"]),
        )
        return s, n + 1, used + jnp.sum(adv)

    zero = jnp.zeros((), jnp.int32)
    return jax.lax.while_loop(cond, body, (state, zero, zero))


@jax.jit
def compact_slots(state: SlotState, idx: jax.Array) -> SlotState:
    """The slots `idx` of `state`, in that order: a state of C = len(idx) slots.

    Every per-row array (cache rows, write indices, positions, steps, budgets, keys, sampler
    state, done flags, output buffers) is gathered, so a row continues from the same state; its
    tokens stay the same where the decode step's per-row arithmetic does not depend on the
    number of rows (the CPU tests check it; a GPU library may choose another reduction order per
    size, which experiments/bench_slots.py would show). Not donated: the result has other
    shapes, so no buffer is reused.

    Args:
        state: B slots.
        idx: [C] int32 slot ids (C <= B); a padding entry names a done slot.

    Returns:
        SlotState of C slots.
    """
    TRACE_COUNTS["compact_slots"] += 1
    c = state.cache

    def rows_of(a):  # [L, B, ...] stacks keep their layer dim; None (no fp8 scales) stays None
        return None if a is None else a[:, idx]

    cache = KVCache(
        k=c.k[:, idx],
        v=c.v[:, idx],
        positions=c.positions[idx],
        index=c.index[idx],
        k_scale=rows_of(c.k_scale),
        v_scale=rows_of(c.v_scale),
    )
    rows = jax.tree.map(lambda x: x[idx], dataclasses.replace(state, cache=None))
    return dataclasses.replace(rows, cache=cache)


@dataclasses.dataclass
class SlotStats:
    """What a slot-refill run did.

    Occupancy is measured per decode step as live rows / rows of the program that ran the step
    (B, or a smaller size after compaction), then averaged three ways.

    Attributes:
        slots: B.
        rows: rows generated.
        steps: decode steps run, at any program size.
        live_row_steps: row-steps that generated a token.
        occupancy: the per-step fraction of the program's rows doing work, averaged over
            steps: sum over sizes C of live_row_steps_C / C, over `steps`.
        row_occupancy: live_row_steps / the row-steps the programs computed (sum of steps_C * C):
            each step weighted by its rows.
        time_weighted_occupancy: the per-size occupancy weighted by the decode seconds spent at
            that size (each step weighted by its measured cost).
        occupancy_while_pending: the occupancy over the decode calls that began with rows still
            pending (all at size B, before the drain, where no row is left to refill a slot);
            None if none.
        steps_by_size: {program size C: decode steps run at C}, largest first.
        decode_s_by_size: {C: host seconds from each `decode_chunk` call at C to its result}.
        compactions: `compact_slots` calls.
        prefills: `slot_prefill` calls.
        chunks: `decode_chunk` calls (host syncs).
        tokens: tokens generated.
        wall_s: seconds of the whole run (compilation included on a first run).
    """

    slots: int
    rows: int
    steps: int
    live_row_steps: int
    occupancy: float
    row_occupancy: float
    time_weighted_occupancy: float
    occupancy_while_pending: float | None
    steps_by_size: dict[int, int]
    decode_s_by_size: dict[int, float]
    compactions: int
    prefills: int
    chunks: int
    tokens: int
    wall_s: float

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def _default_refill_rows(slots: int) -> int:
    # Rows prefilled together: with B / 16 the loop waits for a few free slots (a few percent
    # of occupancy) instead of running one prefill per finished row.
    return max(1, slots // 16)


# The smallest program "auto" compaction uses. Below it a decode step's arithmetic on a GPU is
# not the B-row program's: at 8 rows and fewer the activation quantizer is a kernel of its own
# (its RMSNorm sums in another order than XLA's) and below Config.gemm_min_m the linears are the
# GEMV, not the GEMM. From 16 rows up, with Config.invariant_rows = B (the NVFP4 GEMM's K split
# and the float matmuls planned at B rows), a row's tokens do not depend on the program size.
AUTO_MIN_ROWS = 16


def auto_compacts(params: Params, backend: str | None = None) -> bool:
    """Whether `compact="auto"` compacts for these params on `backend` (default: JAX's): only
    where a smaller program is known to round every row as the B-row program does.

    - GPU: with `Config.xla_autotune=False`. XLA otherwise times algorithms per matmul fusion
      and program, and a padded small program may get another one than the B-row program
      (bf16 compaction changed 28 of 512 rows on the H200 with autotuning, none without).
    - CPU: with float32 weights (the tests). With bf16 weights XLA:CPU's decode loop at 16
      rows came out a bf16 ulp off the 32-row one on some rows (a 2-layer model; a plain
      forward at the two sizes agreed), so bf16 keeps all B slots there.
    - Other backends: not measured, no compaction.
    """
    backend = jax.default_backend() if backend is None else backend
    if backend == "gpu":
        return not params.cfg.xla_autotune
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    return backend == "cpu" and dtype == jnp.float32


_AUTO_OFF_NOTED: list[bool] = []


def _note_auto_off() -> None:
    if _AUTO_OFF_NOTED:
        return
    _AUTO_OFF_NOTED.append(True)
    warnings.warn(
        'slot decoding: compact="auto" keeps all slots to the end here: a smaller program '
        "may round some rows differently (on a GPU while Config.xla_autotune is True, set "
        "xla_autotune=False to compact; on the CPU with bf16 weights); see "
        "rejax.slots.auto_compacts",
        stacklevel=3,
    )


def compact_sizes(slots: int, compact: bool | str | Sequence[int] = "auto") -> tuple[int, ...]:
    """Program sizes a run may use, largest (B) first.

    Args:
        slots: B.
        compact: "auto" for B and the powers of two below it down to `AUTO_MIN_ROWS` (row
            counts whose decode step rounds as B rows do on a GPU); True for B and every power
            of two below it; False for B alone; or the sizes below B to compact to (ints in
            [1, B)).

    Returns:
        Distinct sizes in decreasing order, starting at B.
    """
    if isinstance(compact, str):
        if compact != "auto":
            raise ValueError(
                f"compact must be 'auto', True, False or sizes in [1, slots={slots}), "
                f"got {compact!r}"
            )
        smaller = [1 << k for k in range(slots.bit_length()) if AUTO_MIN_ROWS <= 1 << k < slots]
    elif compact is None or isinstance(compact, (bool, np.bool_)):
        smaller = [1 << k for k in range(slots.bit_length()) if 1 << k < slots] if compact else []
    else:
        smaller = list(compact) if isinstance(compact, (list, tuple, range, np.ndarray)) else [None]
        bad = [c for c in smaller if not isinstance(c, (int, np.integer)) or not 0 < c < slots]
        if bad:
            raise ValueError(
                f"compact must be 'auto', True, False or sizes in [1, slots={slots}), "
                f"got {compact!r}"
            )
    return tuple(sorted({slots, *(int(c) for c in smaller)}, reverse=True))


def generate_rows(
    params: Params,
    prompts: Sequence[Sequence[int]],
    *,
    slots: int,
    max_new_tokens: int | Sequence[int],
    sampler,
    key: jax.Array,
    stop_mask: jax.Array,
    n: int = 1,
    refill_rows: int | None = None,
    max_steps: int = 256,
    bucket: Callable[[int], int] | None = None,
    progress: Callable[[int, int, int], Any] | None = None,
    buffer_tokens: int | None = None,
    compact: bool | str | Sequence[int] = "auto",
) -> tuple[list[tuple], SlotStats]:
    """Generates every (prompt, sample) row through `slots` refilled slots.

    Args:
        params: the model.
        prompts: token ids per prompt (checked by the caller).
        slots: B > 0 slots decoded together.
        max_new_tokens: tokens per row at most, one int or one per row (len(prompts) * n,
            prompt-major).
        sampler: a prepared sampler (ReSET with its newline masks); scalar hyperparameters.
        key: PRNG key; row r = prompt * n + sample uses fold_in(key, r).
        stop_mask: [V] bool stop token ids.
        n: samples per prompt.
        refill_rows: P rows prefilled together (default max(1, B // 16)); the decode loop
            returns to the host once P slots are free (or fewer rows are pending).
        max_steps: decode steps at most between host syncs (progress granularity).
        bucket: prompt length -> padded length (default: rejax.generate's buckets).
        progress: called after each sync as progress(rows done, prompts done, tokens) with
            the counts since the last call.
        buffer_tokens: M, the output buffer width and the cache room past the prompt bucket
            (default: the largest budget); runs with the same M, B and buckets share their
            compiled programs (a benchmark's warm-up).
        compact: once no row is pending, gather the live rows into the next smaller program
            size as soon as they fit ("auto": B/2, B/4, ... down to 16 rows; True: down to 1;
            or the sizes, see `compact_sizes`); False keeps all B slots to the end. The
            decode programs then run with `Config.invariant_rows` = B (unless the config sets
            it), so their matmuls round as B rows do: on a GPU the tokens are those of B-row
            programs at every size of "auto" (measured on the H200: 512 of 512 rows equal to
            static batches, NVFP4 and bf16); below 16 rows they can differ by rounding. "auto"
            compacts only where that is known to hold (`auto_compacts`: on a GPU with
            `Config.xla_autotune=False`, on the CPU with float32 weights); elsewhere it warns
            once and keeps B slots. On the CPU with float32 weights the tokens are the same
            at every size.

    Returns:
        (rows in row order as (tokens, entropy, temperature, stopped) numpy tuples, SlotStats).
    """
    from rejax.generate import _bucket, _pad_batch

    bucket = bucket or _bucket
    for name, v in (("slots", slots), ("n", n), ("max_steps", max_steps)):
        if not isinstance(v, (int, np.integer)) or v <= 0:
            raise ValueError(f"{name} must be a positive int, got {v!r}")
    refill_rows = _default_refill_rows(slots) if refill_rows is None else refill_rows
    if not isinstance(refill_rows, (int, np.integer)) or not 0 < refill_rows <= slots:
        raise ValueError(f"refill_rows must be an int in [1, slots={slots}], got {refill_rows!r}")
    auto = isinstance(compact, str) and compact == "auto"
    if auto and len(compact_sizes(slots, "auto")) > 1 and not auto_compacts(params):
        _note_auto_off()
        compact = False
    sizes = compact_sizes(slots, compact)
    decode_params = params
    if len(sizes) > 1 and params.cfg.invariant_rows is None:
        # the decode programs of every size compute their matmuls as the B-row program does
        # (the prefills keep the plain config: the static path's prefills are the same shapes)
        cfg = dataclasses.replace(params.cfg, invariant_rows=slots)
        decode_params = dataclasses.replace(params, cfg=cfg)
    _check_scalar_sampler(sampler)
    n_rows = len(prompts) * n
    if np.ndim(max_new_tokens) not in (0, 1) or (
        np.ndim(max_new_tokens) == 1 and len(max_new_tokens) != n_rows
    ):
        raise ValueError(
            f"max_new_tokens has shape {np.shape(max_new_tokens)}, expected an int or one per "
            f"row (len(prompts) * n = {n_rows})"
        )
    budgets = np.broadcast_to(np.asarray(max_new_tokens), (n_rows,)).astype(np.int64)
    if n_rows == 0 or budgets.min() <= 0:
        raise ValueError(f"need rows with max_new_tokens > 0, got {n_rows} rows, {budgets.min()=}")
    buckets = [bucket(len(p)) for p in prompts]
    m = int(budgets.max()) if buffer_tokens is None else buffer_tokens
    if not isinstance(m, (int, np.integer)) or m < budgets.max():
        raise ValueError(
            f"buffer_tokens={buffer_tokens!r} is below the largest budget {budgets.max()}"
        )
    length = max(buckets) + m
    t0 = time.perf_counter()
    state = init_slots(params, slots, length, m, sampler)
    pending = list(range(n_rows))[::-1]  # popped from the end: row order
    occupant = [-1] * slots  # row held by each slot of the current program, -1 = none
    size = slots  # rows of the current program (one of `sizes`)
    left_per_prompt = [n] * len(prompts)
    results: list[tuple | None] = [None] * n_rows
    steps_by = dict.fromkeys(sizes, 0)
    used_by = dict.fromkeys(sizes, 0)
    secs_by = dict.fromkeys(sizes, 0.0)
    prefills = chunks = tokens = compactions = 0
    pending_steps = pending_used = 0
    while True:
        free = [b for b in range(size) if occupant[b] < 0]
        take = [pending.pop() for _ in range(min(len(free), len(pending)))]
        by_bucket: dict[int, list[int]] = {}
        for r in take:
            by_bucket.setdefault(buckets[r // n], []).append(r)
        for tb, group in by_bucket.items():
            for i in range(0, len(group), refill_rows):
                part = group[i : i + refill_rows]
                ids = [free.pop(0) for _ in part]
                for b, r in zip(ids, part):
                    occupant[b] = r
                state = _prefill(
                    params,
                    state,
                    prompts,
                    n,
                    part,
                    ids,
                    tb,
                    refill_rows,
                    slots,
                    key,
                    budgets,
                    sampler,
                    _pad_batch,
                )
                prefills += 1
        if all(o < 0 for o in occupant):
            break
        smaller = [c for c in sizes if c < size]
        # One size down at a time (so one compiled gather per size), before decoding: fewer rows
        # than slots may fit a smaller program from the start.
        while not pending and smaller and sum(o >= 0 for o in occupant) <= smaller[0]:
            state, occupant = _compact(state, occupant, smaller[0])
            size, smaller = smaller[0], smaller[1:]
            compactions += 1
        if pending:
            want = min(refill_rows, len(pending))
        elif smaller:
            want = size - smaller[0]  # return once the live rows fit the next size
        else:
            want = size
        t1 = time.perf_counter()
        state, ran, live = decode_chunk(
            decode_params, state, sampler, stop_mask, jnp.int32(want), jnp.int32(max_steps)
        )
        chunks += 1
        done, ran, live = jax.device_get((state.done, ran, live))
        secs_by[size] += time.perf_counter() - t1
        steps_by[size] += int(ran)
        used_by[size] += int(live)
        if pending:
            pending_steps, pending_used = pending_steps + int(ran), pending_used + int(live)
        ended = [b for b in range(size) if occupant[b] >= 0 and done[b]]
        if not ended:
            assert ran > 0, (want, size, occupant)  # else this loop would spin
            continue
        got = _collect(state, ended, refill_rows)
        new_tokens, new_prompts = 0, 0
        for b, row in zip(ended, got):
            r = occupant[b]
            results[r] = row
            occupant[b] = -1
            new_tokens += len(row[0])
            left_per_prompt[r // n] -= 1
            new_prompts += left_per_prompt[r // n] == 0
        tokens += new_tokens
        if progress is not None:
            progress(len(ended), new_prompts, new_tokens)
    steps = sum(steps_by.values())
    used = sum(used_by.values())
    occ_by = {c: used_by[c] / (steps_by[c] * c) for c in sizes if steps_by[c]}
    secs = sum(secs_by[c] for c in occ_by)
    stats = SlotStats(
        slots=slots,
        rows=n_rows,
        steps=steps,
        live_row_steps=used,
        occupancy=sum(used_by[c] / c for c in sizes) / steps if steps else 0.0,
        row_occupancy=used / sum(steps_by[c] * c for c in sizes) if steps else 0.0,
        time_weighted_occupancy=(
            sum(secs_by[c] * occ_by[c] for c in occ_by) / secs if secs > 0 else 0.0
        ),
        occupancy_while_pending=pending_used / (pending_steps * slots) if pending_steps else None,
        steps_by_size={c: steps_by[c] for c in sizes if steps_by[c]},
        decode_s_by_size={c: secs_by[c] for c in sizes if steps_by[c]},
        compactions=compactions,
        prefills=prefills,
        chunks=chunks,
        tokens=tokens,
        wall_s=time.perf_counter() - t0,
    )
    return results, stats


def _compact(state: SlotState, occupant: list[int], c: int) -> tuple[SlotState, list[int]]:
    # The live slots first, then done slots as padding (they keep stepping without recording).
    live = [b for b, o in enumerate(occupant) if o >= 0]
    idle = [b for b, o in enumerate(occupant) if o < 0]
    idx = (live + idle)[:c]
    return compact_slots(state, jnp.asarray(idx, jnp.int32)), [occupant[b] for b in idx]


def _prefill(params, state, prompts, n, part, ids, tb, p, slots, key, budgets, sampler, pad):
    tokens, positions, _, _ = pad([prompts[r // n] for r in part], p, tb)
    slot_ids = np.full((p,), slots, np.int32)  # dummies: out of range, dropped
    slot_ids[: len(part)] = ids
    rows = np.zeros((p,), np.uint32)
    rows[: len(part)] = part
    budget = np.ones((p,), np.int32)
    budget[: len(part)] = budgets[part]
    return slot_prefill(
        params,
        state,
        jnp.asarray(tokens),
        jnp.asarray(positions),
        jnp.asarray(slot_ids),
        key,
        jnp.asarray(rows),
        jnp.asarray(budget),
        sampler,
    )


# Jitted so that the gather runs on the device and only the Q gathered rows are copied to the
# host; Q = refill_rows for every call, so one compiled gather serves the run.
@jax.jit
def _gather(state: SlotState, idx: jax.Array):
    return (
        state.tokens[idx],
        state.entropy[idx],
        state.temperature[idx],
        state.step[idx],
        (state.stopped[idx]),
    )


def _collect(state: SlotState, ended: list[int], q: int) -> list[tuple]:
    out = []
    for i in range(0, len(ended), q):
        part = ended[i : i + q]
        idx = jnp.asarray(part + [part[0]] * (q - len(part)), jnp.int32)
        toks, ent, temp, lens, stopped = jax.device_get(_gather(state, idx))
        out += [
            (toks[j, : lens[j]], ent[j, : lens[j]], temp[j, : lens[j]], bool(stopped[j]))
            for j in range(len(part))
        ]
    return out


def _check_scalar_sampler(sampler) -> None:
    # Slots hold different rows over time, so a per-row [B] hyperparameter has no fixed row.
    for f in dataclasses.fields(sampler):
        if f.name in ("nl_mask", "dnl_mask") or f.metadata.get("static"):
            continue
        v = getattr(sampler, f.name)
        if np.ndim(v) != 0:
            raise ValueError(
                f"slots need scalar sampler hyperparameters; {type(sampler).__name__}.{f.name} "
                f"has shape {np.shape(v)}"
            )


class RowProgress:
    """A tqdm bar on stderr over rows done, with the generated tokens/s; a `progress` callable."""

    def __init__(self, rows: int, slots: int):
        from tqdm.auto import tqdm

        self.bar = tqdm(total=rows, desc=f"generate ({slots} slots)", unit="row")
        self.tokens = 0
        self.t0 = time.perf_counter()

    def __call__(self, rows: int, prompts: int, tokens: int) -> None:
        self.tokens += tokens
        wall = time.perf_counter() - self.t0
        rate = f"{self.tokens / wall:.0f} tok/s" if wall > 0 else ""
        self.bar.set_postfix_str(rate, refresh=False)  # drawn once, by the update below
        self.bar.update(rows)

    def close(self) -> None:
        self.bar.close()
