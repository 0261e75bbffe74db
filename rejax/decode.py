"""Device side of generation: jitted prefill, decode step and the decode loop.

`prefill` and `decode_step` are jitted with the KV cache donated; `decode_loop` runs the same
step body in one jitted `lax.while_loop` with fixed output buffers and a per-row done mask.
Nothing here touches the host (tokenizers, padding and text live in rejax/generate.py).
Dimension letters: see rejax/config.py (B rows, T tokens, S cache slots, V vocab, M max new
tokens).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp

from rejax import compile_cache, sharding
from rejax.cache import KVCache
from rejax.config import compiler_options
from rejax.decoder import forward, logits_out_dtype
from rejax.params import Params
from rejax.sampling import broadcast_rows, sample

# Traces per jitted function; tests read it to check that a second call does not retrace.
TRACE_COUNTS: collections.Counter = collections.Counter()

compile_cache.enable_default()


class _PerCompilerOptions:
    """A jitted function compiled once per compiler-option set of its first argument's
    `params.cfg` (`rejax.config.compiler_options`: `Config.command_buffer`'s command-buffer
    types, `Config.xla_autotune`): XLA takes them per executable, so each set gets its own
    `jax.jit`. `options` replaces the command-buffer table (tests)."""

    def __init__(self, fn, options=None, **jit_kwargs):
        functools.update_wrapper(self, fn)
        self._fn, self._table, self._jit_kwargs = fn, options, jit_kwargs
        self._jits: dict = {}

    def jitted(self, params: Params):
        """The `jax.jit` of this function that `params.cfg`'s compiler options select."""
        cfg = params.cfg
        key = (cfg.command_buffer, cfg.xla_autotune)
        if key not in self._jits:
            opts = compiler_options(cfg, self._table)
            self._jits[key] = jax.jit(
                self._fn, **self._jit_kwargs, **({"compiler_options": opts} if opts else {})
            )
        return self._jits[key]

    def __call__(self, params: Params, *args, **kwargs):
        return self.jitted(params)(params, *args, **kwargs)

    def lower(self, params: Params, *args, **kwargs):
        return self.jitted(params).lower(params, *args, **kwargs)

    def trace(self, params: Params, *args, **kwargs):
        return self.jitted(params).trace(params, *args, **kwargs)


def per_compiler_options(fn=None, **jit_kwargs):
    """Decorator form of `_PerCompilerOptions` (jit keyword arguments as `jax.jit` takes them)."""
    if fn is None:
        return functools.partial(per_compiler_options, **jit_kwargs)
    return _PerCompilerOptions(fn, **jit_kwargs)


def _forward(params: Params, tokens, positions, cache, logits_at=None, logits_dtype=jnp.float32):
    if params.sharding is not None:  # placed on a mesh by rejax.shard
        # float32 of the head's logits (the activation dtype's): cast back, exactly
        head = params.weights["embed_tokens"]["embedding"].dtype
        logits, cache = sharding.forward(params, tokens, positions, cache, logits_at)
        return logits.astype(logits_out_dtype(head, logits_dtype)), cache
    return forward(
        params.weights, tokens, positions, cache, params.cfg, logits_at, logits_dtype=logits_dtype
    )


@per_compiler_options(static_argnames=("all_logits", "logits_dtype"), donate_argnames=("cache",))
def prefill(
    params: Params,
    tokens: jax.Array,
    positions: jax.Array,
    cache: KVCache | None,
    all_logits: bool = False,
    logits_dtype: str | None = "float32",
) -> tuple[jax.Array, KVCache | None]:
    """Runs the prompt through the model, filling the cache.

    Args:
        params: the model.
        tokens: [B, T] int32 prompt ids (padding anywhere, marked by positions).
        positions: [B, T] int32 positions, -1 for padding.
        cache: KVCache with at least T free slots (donated), or None.
        all_logits: return logits for all T tokens instead of each row's last token.
        logits_dtype: "float32", or None for the head's dtype (bfloat16 for a bfloat16 model:
            the same values; what `decode_loop` then carries and samples from, at half the
            bytes).

    Returns:
        (logits [B, V] at each row's last prompt token, or [B, T, V]; the cache).
    """
    TRACE_COUNTS["prefill"] += 1
    logits_at = None if all_logits else jnp.argmax(positions, axis=1)
    return _forward(params, tokens, positions, cache, logits_at, logits_dtype)


def _step(params, logits, cache, positions, sampler, sampler_state, key, step):
    """Samples one token per row from `logits`, then feeds it through the model."""
    # row b draws with fold_in(key[b], step): the grid sampler kernels fold it in their launch
    tokens, sampler_state, info = sample(key, logits, sampler_state, sampler, step=step)
    tokens = tokens.astype(jnp.int32)
    # the next logits in the dtype of these (bfloat16 ones: half the bytes to write, carry and
    # read; float32: the head's logits cast)
    next_logits, cache = _forward(
        params, tokens[:, None], positions[:, None], cache, logits_dtype=logits.dtype
    )
    return tokens, next_logits[:, 0], cache, sampler_state, info


@per_compiler_options(donate_argnames=("cache",))
def decode_step(
    params: Params,
    logits: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    sampler,
    sampler_state,
    key: jax.Array,
    step: jax.Array,
):
    """One decode step: sample from `logits`, then run the sampled token through the model.

    Used by the streaming host loop and by benchmarks; `decode_loop` runs the same body.

    Args:
        params: the model.
        logits: [B, V] logits for the token to sample now, float32 or the head's dtype (the
            next logits come in the same dtype).
        cache: KVCache with a free slot (donated).
        positions: [B] int32 position the sampled token will occupy.
        sampler: Greedy | Temperature | ReSET.
        sampler_state: rejax.sampling.SamplerState.
        key: [B] per-row PRNG keys; row b samples this step with fold_in(key[b], step).
        step: [] int32 index of the token being generated.

    Returns:
        (tokens int32 [B], next logits [B, V] of logits' dtype, cache, sampler_state,
         info {"entropy": [B], "temperature": [B]}).
    """
    TRACE_COUNTS["decode_step"] += 1
    return _step(params, logits, cache, positions, sampler, sampler_state, key, step)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class DecodeState:
    """Carry of the generation while_loop.

    Attributes:
        step: [] int32 tokens generated so far (the loop index).
        logits: [B, V] logits for the next token (the dtype the loop was given).
        cache: KVCache.
        positions: [B] int32 position of the next token per row.
        sampler_state: the sampler's SamplerState.
        done: [B] bool rows that stopped (or are batch padding).
        stopped: [B] bool rows that emitted a stop token.
        lengths: [B] int32 tokens generated per row (stop token included).
        tokens, entropy, temperature: [B, M] output buffers.
    """

    step: jax.Array
    logits: jax.Array
    cache: KVCache
    positions: jax.Array
    sampler_state: Any
    done: jax.Array
    stopped: jax.Array
    lengths: jax.Array
    tokens: jax.Array
    entropy: jax.Array
    temperature: jax.Array


def _steps_per_check(unroll: int, m: int) -> int:
    """Decode steps per check of the loop's predicate: the largest k <= `unroll` dividing M,
    so k-step chunks never run past the M cache slots the caller allotted."""
    return next(k for k in range(max(1, min(unroll, m)), 0, -1) if m % k == 0)


def _decode_loop(
    params: Params,
    logits: jax.Array,
    cache: KVCache,
    positions: jax.Array,
    sampler,
    sampler_state,
    key: jax.Array,
    stop_mask: jax.Array,
    done: jax.Array,
    max_new_tokens: int,
    steps: jax.Array | None = None,
) -> DecodeState:
    """Generates up to M tokens per row in one `lax.while_loop`.

    Rows stop independently when they sample a token in `stop_mask`; the loop ends when every
    row is done or M tokens were generated. Finished rows keep stepping (fixed shapes) but
    their outputs are ignored. An iteration runs `params.cfg.decode_unroll` steps (the largest
    count up to it that divides M) as an inner loop of known trip count, so the host reads the
    loop's predicate once per that many steps; a row that stops inside an iteration is masked
    from there on, as a done row always is.

    Args:
        params: the model.
        logits: [B, V] prefill logits, float32 or the head's dtype (`prefill(...,
            logits_dtype=None)`: bfloat16 for a bfloat16 model, half the bytes each step); the
            loop carries this dtype.
        cache: KVCache with at least M free slots (donated).
        positions: [B] int32 position of the first generated token per row.
        sampler, sampler_state: as in `decode_step`.
        key: [B] per-row PRNG keys; step i of row b uses fold_in(key[b], i).
        stop_mask: [V] bool stop token ids.
        done: [B] bool rows to skip (batch padding).
        max_new_tokens: M (static: the output buffer size).
        steps: [] int32 steps at most (<= M), or None for M; traced, so loops of different
            lengths over the same buffers share one compiled program (a benchmark's batches).

    Returns:
        The final DecodeState (outputs in .tokens/.entropy/.temperature, .lengths, .stopped).
    """
    TRACE_COUNTS["decode_loop"] += 1
    b, m = logits.shape[0], max_new_tokens
    sampler = broadcast_rows(sampler, b)  # once, not every step (sampling.broadcast_rows)
    state = DecodeState(
        step=jnp.zeros((), jnp.int32),
        logits=logits,
        cache=cache,
        positions=positions,
        sampler_state=sampler_state,
        done=done,
        stopped=jnp.zeros((b,), bool),
        lengths=jnp.zeros((b,), jnp.int32),
        tokens=jnp.zeros((b, m), jnp.int32),
        entropy=jnp.zeros((b, m), jnp.float32),
        temperature=jnp.zeros((b, m), jnp.float32),
    )

    limit = m if steps is None else jnp.minimum(steps, m)
    k = _steps_per_check(params.cfg.decode_unroll, m)

    def cond(s: DecodeState):
        return (s.step < limit) & ~jnp.all(s.done)

    def one_step(s: DecodeState):
        # With k > 1 steps per check, a step at or past `limit` changes nothing the caller reads
        # (its token, length and done bits are masked, the step count stays); it still runs the
        # model on a cache slot within the M the caller allotted (k divides M).
        valid = s.step < limit
        tokens, logits, cache, sampler_state, info = _step(
            params, s.logits, s.cache, s.positions, sampler, s.sampler_state, key, s.step
        )
        live = ~s.done & valid
        hit = live & stop_mask[tokens]

        def put(buf, col):
            return jax.lax.dynamic_update_slice(buf, col.astype(buf.dtype)[:, None], (0, s.step))

        return DecodeState(
            step=s.step + valid.astype(jnp.int32),
            logits=logits,
            cache=cache,
            positions=s.positions + 1,
            sampler_state=sampler_state,
            done=s.done | hit,
            stopped=s.stopped | hit,
            lengths=jnp.where(live, s.step + 1, s.lengths),
            tokens=put(s.tokens, jnp.where(live, tokens, 0)),
            entropy=put(s.entropy, info["entropy"]),
            temperature=put(s.temperature, info["temperature"]),
        )

    if k == 1:
        body = one_step
    else:

        def body(s: DecodeState):  # k steps, a loop of known trip count: no predicate copy
            return jax.lax.fori_loop(0, k, lambda _, c: one_step(c), s)

    return jax.lax.while_loop(cond, body, state)


decode_loop = _PerCompilerOptions(
    _decode_loop, static_argnames=("max_new_tokens",), donate_argnames=("cache",)
)
