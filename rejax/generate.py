"""Host side of generation: prompts, buckets, batches, streaming, detokenisation, calibration.

`generate` tokenizes or renders the chat template (rejax/text.py), pads prompts into a few
length buckets, decodes batch x n rows together through the jitted device functions of
rejax/decode.py (`prefill`, `decode_step`, `decode_loop`), and detokenizes. Dimension letters: see
rejax/config.py (B rows, T tokens, S cache slots, V vocab, M max new tokens).
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from tqdm.auto import tqdm

from rejax import sampling, sharding
from rejax.cache import init_cache  # noqa: F401 (callers use rejax.generate's init_cache)
from rejax.decode import TRACE_COUNTS, decode_loop, decode_step, per_compiler_options, prefill
from rejax.decoder import forward, logits_out_dtype
from rejax.params import Params, map_linears
from rejax.text import newline_masks, prompt_ids, require_tokenizer
from rejax.text import stop_mask as text_stop_mask

__all__ = [
    "TRACE_COUNTS",
    "Generation",
    "calibrate_input_scales",
    "decode_loop",
    "decode_step",
    "generate",
    "logits",
    "prefill",
]

# Prompt lengths are padded up to one of these (then to multiples of the largest), so a
# handful of compiled shapes serve every prompt.
_BUCKETS = (32, 64, 128, 256, 512, 1024, 2048, 4096)

# An E2M1 activation's largest magnitude times E4M3's largest scale: input_scale = amax / this.
_FP4_X_FP8_MAX = 6.0 * 448.0


# ----------------------------------------------------------------------------- host side


@dataclasses.dataclass
class Generation:
    """Generated continuations, one entry per row (prompt-major: prompt i's n samples are
    rows i*n .. i*n+n-1).

    Attributes:
        tokens: generated ids per row, prompt excluded, stop token included.
        text: decoded text per row (special tokens skipped; "" without a tokenizer).
        entropy: per-token raw (T=1) entropy in nats, per row.
        temperature: per-token temperature the sampler used, per row.
        finish_reason: "stop" (a stop token was sampled) or "length" per row.
        slot_stats: with `slots`, what the slot-refill run did (rejax.slots.SlotStats as a
            dict: occupancy, steps, prefills, ...); None otherwise.
    """

    tokens: list[list[int]]
    text: list[str]
    entropy: list[list[float]]
    temperature: list[list[float]]
    finish_reason: list[str]
    slot_stats: dict | None = None


def _bucket(length: int) -> int:
    for b in _BUCKETS:
        if length <= b:
            return b
    top = _BUCKETS[-1]
    return -(-length // top) * top


def _prepare_sampler(params: Params, sampler):
    if not isinstance(sampler, (sampling.Greedy, sampling.Temperature, sampling.ReSET)):
        raise ValueError(  # noqa: TRY004 (bad input is a ValueError in rejax)
            f"unknown sampler type {type(sampler).__name__}; expected "
            "rejax.Greedy(), rejax.Temperature(...) or rejax.ReSET(...)"
        )
    if isinstance(sampler, sampling.ReSET) and (
        sampler.nl_mask is None or sampler.dnl_mask is None
    ):
        tok = require_tokenizer(params, "ReSET's newline masks")
        nl, dnl = newline_masks(tok, params.cfg.vocab_size)
        sampler = dataclasses.replace(sampler, nl_mask=jnp.asarray(nl), dnl_mask=jnp.asarray(dnl))
    return sampler


def _pad_batch(prompts: list[list[int]], rows: int, bucket: int):
    """Left-pads prompts into [rows, bucket]; rows past len(prompts) are dummy (done)."""
    tokens = np.zeros((rows, bucket), np.int32)
    positions = np.full((rows, bucket), -1, np.int32)
    lengths = np.ones((rows,), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, bucket - len(p) :] = p
        positions[r, bucket - len(p) :] = np.arange(len(p))
        lengths[r] = len(p)
    # Dummy rows hold one token at position 0 so their attention is well defined.
    positions[len(prompts) :, -1] = 0
    done = np.arange(rows) >= len(prompts)
    return tokens, positions, lengths, done


def generate(
    params: Params,
    prompt: str | Sequence[str] | Sequence[Sequence[int]],
    *,
    max_new_tokens: int = 256,
    sampler=None,
    key: int | jax.Array = 0,
    n: int = 1,
    stop: Iterable[int | str] | None = None,
    batch_size: int | None = None,
    chat: bool = False,
    stream: bool | Callable[[str], Any] = False,
    on_token: Callable[[int, float, float], Any] | None = None,
    progress: bool | Callable[[int, int], Any] | None = None,
    slots: int | None = None,
    compact: bool | str = "auto",
    prefill_rows: int | None = None,
) -> Generation:
    """Generates continuations for one or many prompts.

    Prompts are tokenized (or rendered through the chat template with `chat=True`), each is
    repeated n times, and batch_size prompts (batch_size * n rows) are decoded together: one
    jitted prefill and one jitted while_loop per batch. Prompt lengths are padded to a few
    buckets and the last batch is padded with dummy rows, so equal-shaped calls reuse the
    compiled code. Results are deterministic for a key.

    Args:
        params: the model (with a tokenizer for text prompts, chat and ReSET).
        prompt: a str, a list of str, or token ids as a list of lists.
        max_new_tokens: M > 0 tokens to generate at most per row.
        sampler: rejax.Greedy() (default), rejax.Temperature(...) or rejax.ReSET(...); ReSET's
            newline masks are filled from the tokenizer when None.
        key: int seed or PRNG key. Row r (prompt-major over all prompts) samples step i with
            fold_in(fold_in(key, r), i), so results do not depend on batch_size.
        n: samples per prompt.
        stop: stop token ids (or single-token strings); None = the config's and
            generation_config's EOS ids; [] = never stop early.
        batch_size: prompts per batch (default: all at once).
        chat: render each text prompt as one user message with the chat template.
        stream: True prints text to stdout as it is generated, or a callable receiving each
            new text piece; single prompt with n=1 only (host loop over `decode_step`).
        on_token: with `stream`, called after each generated token (and after its text piece)
            as on_token(token_id, raw entropy in nats, temperature used); per-step statistics
            are built on it.
        progress: show a tqdm bar over batches (None: when there is more than one batch), or a
            callable called after each batch as progress(prompts_done, tokens_generated) with
            that batch's counts, for a caller's own progress report. With `slots` the bar
            counts rows and the callable is called after each host sync.
        slots: decode through this many refilled row slots (rejax/slots.py) instead of static
            batches: a slot whose row ends takes the next pending (prompt, sample) row. Same
            tokens as static batches; excludes batch_size and stream.
        compact: with `slots`, once no row is pending, move the live rows into the next
            smaller program as soon as they fit, so the last long rows do not run in a B-row
            program: "auto" B/2, B/4, ... down to 16 rows (the same tokens as B-row programs;
            on a GPU only with `Config.xla_autotune=False`, on the CPU for float32 weights
            only, else it keeps all B slots: `rejax.slots.auto_compacts`), True down to 1 row
            (below 16 rows a GPU's rounding, or bf16 on the CPU, may change a token), False
            keeps all B slots (`rejax.slots.compact_sizes`).
        prefill_rows: P rows prefilled together. Static batches (default None: each batch in
            one prefill) then prefill their rows in chunks of P prompts of one bucket, each
            chunk as a slot refill does (`rejax.slots.prefill_rows`). With `slots`, P rows per
            refill (default max(1, slots // 16)). On a GPU a linear's rounding can depend on
            its row count, so a row's tokens can depend on the rows prefilled beside it; with
            the same P in both the prefills have the same shapes and the two paths give the
            same tokens there too. On the CPU the tokens do not depend on P.

    Returns:
        Generation with one row per (prompt, sample).
    """
    if sampler is None:
        sampler = sampling.Greedy()
    if not isinstance(max_new_tokens, (int, np.integer)) or max_new_tokens <= 0:
        raise ValueError(f"max_new_tokens must be a positive int, got {max_new_tokens!r}")
    if not isinstance(n, (int, np.integer)) or n <= 0:
        raise ValueError(f"n must be a positive int, got {n!r}")
    sampler = _prepare_sampler(params, sampler)
    prompts = prompt_ids(params, prompt, chat)
    if prefill_rows is not None and (
        not isinstance(prefill_rows, (int, np.integer)) or prefill_rows <= 0 or stream
    ):
        raise ValueError(
            f"prefill_rows must be a positive int or None (and excludes stream), got "
            f"{prefill_rows!r}"
        )
    if slots is not None and (batch_size is not None or stream):
        raise ValueError(f"slots={slots!r} excludes batch_size and stream (got {batch_size=})")
    if slots is not None and prefill_rows is not None and prefill_rows > slots:
        raise ValueError(
            f"prefill_rows={prefill_rows} exceeds slots={slots!r}: a refill fills at most "
            "every slot"
        )
    if batch_size is None:
        batch_size = len(prompts)
    if not isinstance(batch_size, (int, np.integer)) or batch_size <= 0:
        raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
    limit = params.cfg.max_position_embeddings
    for i, p in enumerate(prompts):
        if len(p) + max_new_tokens > limit:
            raise ValueError(
                f"prompt[{i}] has {len(p)} tokens; with max_new_tokens="
                f"{max_new_tokens} that exceeds max_position_embeddings={limit}"
            )
    stop_mask = jnp.asarray(text_stop_mask(params, stop))
    if isinstance(key, (int, np.integer)):
        key = jax.random.key(int(key))
    if stream:
        if len(prompts) != 1 or n != 1:
            raise ValueError(
                f"stream=True needs a single prompt with n=1, got {len(prompts)} prompts and {n=}"
            )
        emit = stream if callable(stream) else _print_piece
        return _generate_stream(
            params,
            prompts[0],
            max_new_tokens,
            sampler,
            _row_keys(key, 0, 1),
            stop_mask,
            emit,
            on_token,
        )
    if on_token is not None:
        raise ValueError("on_token needs stream=True (or a stream callable)")
    if slots is not None:
        return _generate_slots(
            params,
            prompts,
            n,
            slots,
            max_new_tokens,
            sampler,
            key,
            stop_mask,
            progress,
            compact,
            prefill_rows,
        )

    batches = [prompts[i : i + batch_size] for i in range(0, len(prompts), batch_size)]
    report = progress if callable(progress) else None
    show = report is None and (len(batches) > 1 if progress is None else bool(progress))
    it = enumerate(batches)
    if show:
        it = tqdm(it, total=len(batches), desc="generate", unit="batch")
    rows: list[tuple] = []
    for j, batch in it:
        keys = _row_keys(key, j * batch_size * n, batch_size * n)
        done = _generate_batch(
            params, batch, n, batch_size * n, max_new_tokens, sampler, keys, stop_mask, prefill_rows
        )
        rows.extend(done)
        if report is not None:
            report(len(batch), sum(len(r[0]) for r in done))
    return _to_generation(params, rows)


def _generate_slots(
    params, prompts, n, slots, max_new_tokens, sampler, key, stop_mask, progress, compact, p=None
):
    from rejax.slots import RowProgress, generate_rows

    def prompts_done(rows, done, tokens):  # the batch path's progress(prompts, tokens)
        progress(done, tokens)

    bar = None
    if callable(progress):
        report = prompts_done
    elif progress or progress is None:
        bar = report = RowProgress(len(prompts) * n, slots)
    else:
        report = None
    try:
        rows, stats = generate_rows(
            params,
            prompts,
            slots=slots,
            max_new_tokens=max_new_tokens,
            sampler=sampler,
            key=key,
            stop_mask=stop_mask,
            n=n,
            progress=report,
            compact=compact,
            refill_rows=p,
        )
    finally:
        if bar is not None:
            bar.close()
    return dataclasses.replace(_to_generation(params, rows), slot_stats=stats.as_dict())


def _row_keys(key, first: int, rows: int) -> jax.Array:
    """[rows] keys fold_in(key, first + r)."""
    return jax.vmap(jax.random.fold_in, in_axes=(None, 0))(
        key, jnp.arange(first, first + rows, dtype=jnp.uint32)
    )


def _generate_batch(
    params, prompts, n, rows, max_new_tokens, sampler, key, stop_mask, prefill_rows=None
):
    expanded = [p for p in prompts for _ in range(n)]
    bucket = _bucket(max(len(p) for p in expanded))
    tokens, positions, lengths, done = _pad_batch(expanded, rows, bucket)
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    cache = sharding.init_cache(params, rows, bucket + max_new_tokens, dtype)
    if prefill_rows is None:
        # the head's logits as they are (bfloat16 for a bfloat16 model: the decode loop carries
        # and samples half the bytes, the same values)
        logits, cache = prefill(
            params, jnp.asarray(tokens), jnp.asarray(positions), cache, logits_dtype=None
        )
    else:
        logits, cache = prefill_chunked(params, expanded, cache, prefill_rows)
    out = decode_loop(
        params,
        logits,
        cache,
        jnp.asarray(lengths),
        sampler,
        sampling.sampler_init(sampler, rows),
        key,
        stop_mask,
        jnp.asarray(done),
        max_new_tokens=max_new_tokens,
    )
    toks, ent, temp, lens, stopped = jax.device_get(
        (out.tokens, out.entropy, out.temperature, out.lengths, out.stopped)
    )
    return [
        (toks[r, : lens[r]], ent[r, : lens[r]], temp[r, : lens[r]], bool(stopped[r]))
        for r in range(len(expanded))
    ]


def prefill_chunked(params: Params, prompts, cache, p: int):
    """Prefills a static batch's rows in chunks of P prompts of one bucket, as slot refills do.

    Args:
        params: the model.
        prompts: token ids per row (at most B = cache rows); the rows past them are dummies
            holding one token at position 0, as `_pad_batch` makes them.
        cache: a fresh [B]-row cache with room for the longest prompt's bucket.
        p: P rows per chunk (the last chunk of a bucket padded with dropped dummy rows).

    Returns:
        (logits [B, V] at each row's last prompt token in the head's dtype, the cache with a
        per-row write index [B]: each row's prompt at slots [0, its bucket)).
    """
    rows = cache.batch_size
    cache = dataclasses.replace(cache, index=jnp.zeros((rows,), jnp.int32))
    head = params.weights["embed_tokens"]["embedding"].dtype
    logits = jnp.zeros((rows, params.cfg.vocab_size), logits_out_dtype(head, None))
    full = [list(q) for q in prompts] + [[0]] * (rows - len(prompts))
    groups: dict[int, list[int]] = {}
    for r, q in enumerate(full):
        groups.setdefault(_bucket(len(q)), []).append(r)
    for tb, group in groups.items():
        for i in range(0, len(group), p):
            part = group[i : i + p]
            tokens, positions, _, _ = _pad_batch([full[r] for r in part], p, tb)
            ids = np.full((p,), rows, np.int32)  # dummies: out of range, dropped
            ids[: len(part)] = part
            logits, cache = _prefill_put(
                params, logits, cache, jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(ids)
            )
    return logits, cache


@per_compiler_options(donate_argnames=("logits", "cache"))
def _prefill_put(params, logits, cache, tokens, positions, ids):
    from rejax.slots import prefill_rows

    TRACE_COUNTS["prefill_rows"] += 1
    part, cache = prefill_rows(params, cache, tokens, positions, ids)
    return logits.at[ids].set(part, mode="drop"), cache


def _print_piece(piece: str) -> None:
    sys.stdout.write(piece)
    sys.stdout.flush()


def _generate_stream(params, prompt, max_new_tokens, sampler, key, stop_mask, emit, on_token=None):
    bucket = _bucket(len(prompt))
    tokens, positions, lengths, _ = _pad_batch([prompt], 1, bucket)
    dtype = params.weights["embed_tokens"]["embedding"].dtype
    cache = sharding.init_cache(params, 1, bucket + max_new_tokens, dtype)
    logits, cache = prefill(
        params, jnp.asarray(tokens), jnp.asarray(positions), cache, logits_dtype=None
    )
    state = sampling.sampler_init(sampler, 1)
    pos = jnp.asarray(lengths)
    stop = np.asarray(stop_mask)
    tok = None if params.tokenizer is None else params.tokenizer.tokenizer
    out, ent, temp, shown, stopped = [], [], [], "", False
    for step in range(max_new_tokens):
        t, logits, cache, state, info = decode_step(
            params, logits, cache, pos, sampler, state, key, jnp.int32(step)
        )
        pos = pos + 1
        t = int(t[0])
        out.append(t)
        ent.append(float(info["entropy"][0]))
        temp.append(float(info["temperature"][0]))
        if tok is not None:
            text = tok.decode(out, skip_special_tokens=True)
            # Hold back an incomplete UTF-8 sequence until the next token completes it.
            if not text.endswith("\ufffd") and text.startswith(shown):
                emit(text[len(shown) :])
                shown = text
        if on_token is not None:
            on_token(t, ent[-1], temp[-1])
        if stop[t]:
            stopped = True
            break
    if tok is not None:
        text = tok.decode(out, skip_special_tokens=True)
        if text.startswith(shown) and len(text) > len(shown):
            emit(text[len(shown) :])
    return _to_generation(params, [(np.asarray(out), np.asarray(ent), np.asarray(temp), stopped)])


def _to_generation(params: Params, rows) -> Generation:
    tok = None if params.tokenizer is None else params.tokenizer.tokenizer
    tokens = [[int(t) for t in r[0]] for r in rows]
    return Generation(
        tokens=tokens,
        text=[tok.decode(t, skip_special_tokens=True) if tok is not None else "" for t in tokens],
        entropy=[[float(e) for e in r[1]] for r in rows],
        temperature=[[float(e) for e in r[2]] for r in rows],
        finish_reason=["stop" if r[3] else "length" for r in rows],
    )


def logits(params: Params, tokens) -> jax.Array:
    """Full-sequence logits without a cache (scoring and tests).

    Args:
        params: the model.
        tokens: [B, T] int token ids, no padding.

    Returns:
        float32 [B, T, V].
    """
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or tokens.shape[1] == 0 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(
            f"tokens must be int [B, T] with T > 0, got {tokens.shape=} {tokens.dtype=}"
        )
    v, limit = params.cfg.vocab_size, params.cfg.max_position_embeddings
    if tokens.shape[1] > limit:
        raise ValueError(f"{tokens.shape=} exceeds max_position_embeddings={limit}")
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0 or hi >= v:
        raise ValueError(f"token ids span [{lo}, {hi}], outside [0, {v})")
    positions = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32), tokens.shape)
    return prefill(params, tokens.astype(jnp.int32), positions, None, all_logits=True)[0]


def calibrate_input_scales(
    params: Params, texts: str | Sequence[str] | Sequence[Sequence[int]]
) -> Params:
    """Sets each NVFP4 linear's static activation scale from calibration text.

    Runs every text (unpadded, one at a time) through the model with NVFP4 weights and bf16
    activations (activation quantizers off while calibrating, as ModelOpt does), records each
    linear's input amax over all texts, and sets `input_scale = amax / (6 * 448)`.

    Args:
        params: an NVFP4 W4A4 model (cfg.quant == "nvfp4").
        texts: calibration strings (needs a tokenizer) or token-id lists.

    Returns:
        Params with an `input_scale` f32 [L] (one per layer) in every decoder linear.
    """
    cfg = params.cfg
    if cfg.quant != "nvfp4":
        raise ValueError(
            f"calibrate_input_scales needs cfg.quant == 'nvfp4' (W4A4), got {cfg.quant!r}"
        )
    if params.sharding is not None:
        raise ValueError("calibrate_input_scales takes one-device params (rejax.sharding.unshard)")
    prompts = prompt_ids(params, texts, chat=False)
    bare = map_linears(
        params.weights, lambda _, p: {k: x for k, x in p.items() if k != "input_scale"}
    )
    # NVFP4 weights, bf16 activations while calibrating. One compiled forward per text
    # length (a one-off pass, not part of generation).
    w4a16 = dataclasses.replace(cfg, quant="nvfp4-w4a16")
    run = jax.jit(lambda w, t, p: forward(w, t, p, None, w4a16, with_amax=True)[2])
    amax: dict = {}
    for p in prompts:
        tokens = jnp.asarray([p], jnp.int32)
        positions = jnp.arange(len(p), dtype=jnp.int32)[None]
        found = jax.device_get(run(bare, tokens, positions))  # {name: f32 [L]}
        for name, per_layer in found.items():
            amax[name] = np.maximum(amax.get(name, 0.0), np.asarray(per_layer, np.float32))
    tiny = np.float32(np.finfo(np.float32).tiny)

    def set_scale(path, p):
        scale = np.maximum(amax[path[1]], tiny) / np.float32(_FP4_X_FP8_MAX)
        return {**p, "input_scale": jnp.asarray(scale, jnp.float32)}

    return dataclasses.replace(params, weights=map_linears(bare, set_scale))
