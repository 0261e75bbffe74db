"""Token sampling: greedy, temperature with top-k / top-p, and the ReSET entropy policy.

Everything here is a pure function over `[B, V]` float32 logits and a carried `SamplerState`
pytree, so it runs inside a jitted decode loop with no host synchronisation. Sampler
hyperparameters are traced leaves (sweeps never recompile); only `window`, `include_current` and
`top_k` are static.

ReSET (the ReSET paper) picks a per-token temperature from the raw T=1 full-vocabulary entropy H_t:
T_t = T_high if H_t >= tau_t else T_low, where tau_t is the step entropy estimate when the
current reasoning step is more uncertain than the response so far (SAT, Eq. 1) and tau_0
otherwise; the step entropy estimate is a w-token window mean during a step's first w tokens
and the in-step mean after that (HSE, Eq. 2). The default follows the official implementation
("reference semantics", the official implementation's): the estimates use positions before t only, the first
token of a response uses its own entropy, and the window crosses step boundaries.

Top-p follows vLLM: a token is dropped when the mass of the tokens ranked below it, itself
included, is <= 1 - top_p, and the most likely token is always kept. Tokens are ranked by
probability with ties ordered as a stable ascending sort leaves them (the lower id ranks lower).
Masses are counted exactly, in integer units of 2**-30 (`_MASS_BITS`), so the kept set does not
depend on summation order and every implementation agrees token for token (a token below 2**-31
has zero mass: it is kept only when top_p = 1). Implementations (`TOP_P_METHODS`, timed side by
side by experiments/bench_sampler.py):

- "topk": the 16 most likely tokens (`lax.top_k`, a single small-k kernel on GPU) and
  the row's total mass decide the kept set whenever it ends inside them, and the draw is then a
  Gumbel-max over those 16 candidates only. Rows whose nucleus reaches past the candidates (or
  ends inside a tie group that the 16th token splits) fall back to "radix" under a `lax.cond`
  that runs only when some row needs it (its predicate is still read once per call).
- "radix" (the default): finds the boundary probability with a fixed number of counting passes
  over V.
- "sort": a full sort of V, the definition.

Top-k with k > 16 is found by rounds of 16 (`_kth_largest`), since XLA's GPU top-k kernel stops at
16 and a larger k becomes a sort of V. The draw is Gumbel-max over the kept tokens, so sampling
needs no cumulative sum either. Its noise (`_gumbel`) takes 40 random bits a token and computes
-log(-log(1 - u)) from whichever of u and 1 - u is the smaller, so its far tail is right: tokens
~1e-7 of the top one, of which a peaked 152K-token row holds ~1% of the mass, get their share.

The row statistics (max and argmax, the entropy's two sums, the softmax denominators at the
temperatures the sampler may apply) take a max pass and one fused pass over V ("two_pass", the
default) or a single rescaling reduction ("online"; `STATS_METHODS`, same values up to float
rounding).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from rejax.ops import sampler as sampler_op
from rejax.text import ends_step

GREEDY_EPS = 1e-6  # a temperature <= this samples greedily (argmax of the raw logits)
TOP_P_METHODS = ("topk", "radix", "sort")  # exact top-p mask implementations (module docstring)
# How `sample` finds the nucleus and draws: "kernel" (the default), the fused op
# `rejax.ops.sampler.sample_top_p`, the CUDA kernels on a GPU when they support the call and the
# "radix" computation elsewhere (so CPU results are those of "radix", bit for bit), or a mask
# method. "kernel" became the default once its GPU tests passed on the H200 with the 55-bit
# noise (all 24 of tests/test_sampling_gpu.py, the seven chi-square tests included;
# experiments/results/h200_e/): over greedy it costs 15.3 us against "radix"'s 90.8 us at batch
# 1 and 117.7 against 948.5 at batch 64 (Temperature(0.6) + top-p 0.95, kernel alone), +24.7
# against +105.6 us per token in the 36-layer decode loop at batch 1. (An earlier revision drew
# its Gumbel noise from 23-bit uniforms and failed one far-tail chi-square test there, as
# "radix" did on CPU; experiments/results/sampler_tail_bias_cpu.md.)
# "kernel-split" / "kernel-cluster" / "kernel-merge" / ... are "kernel" with the CUDA kernels'
# variant named (`rejax.ops.sampler.VARIANTS`; "kernel" takes `rejax.ops.sampler.VARIANT`), for
# A/B timings in one decode loop; "kernel-grid-state" (`rejax.ops.sampler.STATE_VARIANT`) and
# "kernel-cdf-state" are "kernel-grid" / "kernel-cdf" with ReSET's state update in the kernel
# (what "kernel" runs for ReSET wherever "auto" picks "grid" / "cdf": "cdf" for top-p alone)
KERNEL_METHODS = {"kernel": None, **{f"kernel-{v}": v for v in sampler_op.VARIANTS}}
KERNEL_METHODS |= {f"kernel-{v}": v for v in sampler_op.STATE_VARIANTS}  # "kernel-cdf-state"
SAMPLE_METHODS = (*KERNEL_METHODS, *TOP_P_METHODS)
TOP_P_METHOD = "kernel"
# The mask default: on the H200 (36-layer Qwen3-8B NVFP4 decode loop, batch 1) ReSET + top-p
# cost +80 us per step with "radix" and +415 us with "topk", whose lax.top_k over 152K entries
# is not XLA's fast TopK path (experiments/results/decode_h200_b/README.md)
MASK_METHOD = "radix"
STATS_METHODS = ("two_pass", "online")  # how `sample` gets max, entropy, denominators
STATS_METHOD = "two_pass"  # the default, until the GPU timing of "online" decides

_MASS_BITS = 30  # probabilities are counted in integer units of 2**-30
# Smallest float32 bit pattern whose probability has a non-zero mass: round(p * 2**30) >= 1
# needs p > 2**-31, whose bit pattern is (127 - 31) << 23. Masses live in (this, 1.0].
_KEY_LO = (127 - 31) << 23
_KEY_BITS = 28  # bit patterns of (2**-31, 1.0] are _KEY_LO + [1, 0x0F800000] < _KEY_LO + 2**28
_RADIX_BITS = 4  # bits resolved per selection round (15 thresholds per pass over V)
# Candidates of the "topk" method and the width of one top-k round: XLA's GPU TopK kernel serves
# k <= 16 (TopkSpecializer); above that lax.top_k is a sort of the whole row.
_TOPK_FAST = 16


# ----------------------------------------------------------------------------- samplers


def _concrete(x: Any) -> np.ndarray | None:
    """The value of `x` as a NumPy array, or None if it is traced (or not an array at all)."""
    if isinstance(x, (bool, int, float, np.ndarray, np.generic)):
        return np.asarray(x)
    if isinstance(x, jax.Array):
        try:
            return np.asarray(x)
        except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
            return None
    return None


def _check_value(name: str, x: Any, ok, expected: str) -> None:
    v = _concrete(x)
    if v is None:
        return
    if v.ndim > 1:
        raise ValueError(f"{name} must be a scalar or a [B] vector, got shape {v.shape}")
    if not np.issubdtype(v.dtype, np.number) or not np.all(ok(v.astype(np.float64))):
        raise ValueError(f"{name}={x!r} is invalid: expected {expected}")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Greedy:
    """Always take the most likely token (argmax of the raw logits; first id on ties)."""


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Temperature:
    """Sample from softmax(logits / t), restricted by top-k then top-p (vLLM order).

    Attributes:
      t: temperature, > 0 (scalar or per-row [B]); t <= 1e-6 samples greedily.
      top_p: nucleus mass in (0, 1] (scalar or [B]); 1.0 keeps every token.
      top_k: keep the tokens whose tempered logit is >= the k-th largest (ties at the k-th value
        kept, as vLLM does); 0 disables. Static.
      top_p_method: one of `SAMPLE_METHODS`, how the nucleus is found (same kept set). Static.
    """

    t: Any
    top_p: Any = 1.0
    top_k: int = dataclasses.field(default=0, metadata={"static": True})
    top_p_method: str = dataclasses.field(default=TOP_P_METHOD, metadata={"static": True})

    def __post_init__(self):
        _check_method(self.top_p_method)
        _check_value("Temperature.t", self.t, lambda v: v > 0, "t > 0 (t <= 1e-6 is greedy)")
        _check_value(
            "Temperature.top_p", self.top_p, lambda v: (v > 0) & (v <= 1), "0 < top_p <= 1"
        )
        if not isinstance(self.top_k, (int, np.integer)) or self.top_k < 0:
            raise ValueError(f"Temperature.top_k={self.top_k!r} is invalid: expected an int >= 0")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class ReSET:
    """The ReSET temperature policy followed by top-p sampling (the ReSET paper).

    Attributes:
      t_high, t_low: temperatures for tokens at / below the threshold (>= 0; <= 1e-6 is greedy).
      tau_0: the confident-step entropy threshold in nats.
      window: HSE window w (static).
      nl_mask, dnl_mask: bool [V] single-newline / double-newline token sets
        (`rejax.text.newline_masks`); None is allowed at construction, `sample` and `reset_observe` require them.
      top_p: nucleus mass in (0, 1], applied after the policy's temperature.
      include_current: False = reference semantics (current token excluded from the estimates);
        True = figure semantics (window H_{t-w+1..t}, in-step and running means include H_t).
        Static.
      top_p_method: one of `SAMPLE_METHODS`, how the nucleus is found (same kept set). Static.
    """

    t_high: Any = 1.0
    t_low: Any = 0.3
    tau_0: Any = 0.6349
    window: int = dataclasses.field(default=32, metadata={"static": True})
    nl_mask: Any = None
    dnl_mask: Any = None
    top_p: Any = 0.95
    include_current: bool = dataclasses.field(default=False, metadata={"static": True})
    top_p_method: str = dataclasses.field(default=TOP_P_METHOD, metadata={"static": True})

    def __post_init__(self):
        _check_method(self.top_p_method)
        _check_value("ReSET.t_high", self.t_high, lambda v: v >= 0, "t_high >= 0")
        _check_value("ReSET.t_low", self.t_low, lambda v: v >= 0, "t_low >= 0")
        _check_value("ReSET.tau_0", self.tau_0, np.isfinite, "a finite entropy in nats")
        _check_value("ReSET.top_p", self.top_p, lambda v: (v > 0) & (v <= 1), "0 < top_p <= 1")
        if not isinstance(self.window, (int, np.integer)) or self.window < 1:
            raise ValueError(f"ReSET.window={self.window!r} is invalid: expected an int >= 1")
        if not isinstance(self.include_current, bool):
            raise ValueError(  # noqa: TRY004 (bad input is a ValueError in rejax)
                f"ReSET.include_current={self.include_current!r}: expected a bool"
            )
        for name in ("nl_mask", "dnl_mask"):
            m = getattr(self, name)
            if isinstance(m, (np.ndarray, jax.Array)) and (m.ndim != 1 or m.dtype != np.bool_):
                raise ValueError(
                    f"ReSET.{name} must be a bool [V] mask, got {m.dtype} with shape {m.shape}"
                )


Sampler = Greedy | Temperature | ReSET


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class SamplerState:
    """Per-row running statistics of one response (the official implementation's reference semantics), cleared at its start.

    Attributes:
      ring: f32 [B, w] the last <= w token entropies (crosses step boundaries); unused slots 0.
      n_ring: i32 [B] valid ring entries (<= w).
      ring_pos: i32 [B] slot the next entropy is written to.
      s_sum, s_n: f32 [B], i32 [B] entropy sum / count since the current step began.
      g_sum, g_n: f32 [B], i32 [B] entropy sum / count of all generated tokens.
      y1, y2: i32 [B] the last and second-to-last generated ids (-1 = none).
    """

    ring: jax.Array
    n_ring: jax.Array
    ring_pos: jax.Array
    s_sum: jax.Array
    s_n: jax.Array
    g_sum: jax.Array
    g_n: jax.Array
    y1: jax.Array
    y2: jax.Array


def reset_init(batch_size: int, window: int) -> SamplerState:
    """A cleared ReSET state for `batch_size` rows and HSE window `window`."""
    if not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size={batch_size!r} is invalid: expected an int >= 1")
    if not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"window={window!r} is invalid: expected an int >= 1")
    zf = jnp.zeros((batch_size,), jnp.float32)
    zi = jnp.zeros((batch_size,), jnp.int32)
    none = jnp.full((batch_size,), -1, jnp.int32)
    return SamplerState(
        ring=jnp.zeros((batch_size, window), jnp.float32),
        n_ring=zi,
        ring_pos=zi,
        s_sum=zf,
        s_n=zi,
        g_sum=zf,
        g_n=zi,
        y1=none,
        y2=none,
    )


def sampler_init(sampler: Sampler, batch_size: int) -> SamplerState:
    """The initial state for any sampler (non-ReSET samplers carry a w=1 state they ignore)."""
    _check_sampler(sampler)
    return reset_init(batch_size, sampler.window if isinstance(sampler, ReSET) else 1)


# ----------------------------------------------------------------------------- entropy


def _max_argmax(z: jax.Array) -> tuple[jax.Array, jax.Array]:
    # The row max and jnp.argmax's index (first index among equal values, NaN wins) from one
    # variadic reduction, so the greedy token and the softmax shift share a pass over V.
    def pick(a, b):
        (av, ai), (bv, bi) = a, b
        a_val = (av > bv) | jnp.isnan(av)
        a_idx = a_val | ((av == bv) & (ai < bi))
        return jnp.where(a_val, av, bv), jnp.where(a_idx, ai, bi)

    ids = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    init = (jnp.array(-jnp.inf, z.dtype), jnp.array(0, jnp.int32))
    m, i = lax.reduce((z, ids), init, pick, (1,))
    return m[:, None], i


def _max_and_entropy(z: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    # H = logsumexp(z) - sum(p z), shifted by the row max m: one max pass (with the argmax)
    # plus one fused pass for the two sums. -inf logits contribute 0 (not 0 * inf).
    m, top = _max_argmax(z)
    d = z - m
    e = jnp.exp(d)
    s = jnp.sum(e, axis=-1)
    u = jnp.sum(jnp.where(e > 0, e * d, 0.0), axis=-1)
    return m, jnp.log(s) - u / s, top


def _online_stats(z: jax.Array, inv_ts: tuple[jax.Array, ...]):
    # One variadic reduction over V for the row max, its first index, the two entropy sums and
    # sum(exp((z - m) * inv_t)) for each inv_t [B]: partial results at different maxima are
    # rescaled when combined (online softmax), so nothing waits for a separate max pass. Same
    # quantities as _max_and_entropy up to float rounding; -inf logits contribute nothing.
    live = z > -jnp.inf
    one = jnp.where(live, 1.0, 0.0).astype(jnp.float32)
    ids = lax.broadcasted_iota(jnp.int32, z.shape, 1)
    invs = [jnp.broadcast_to(x[:, None], z.shape) for x in inv_ts]
    n = len(inv_ts)

    def pick(a, c):
        (am, ai, as_, au, *ar), (cm, ci, cs, cu, *cr) = a, c
        a_val = (am > cm) | jnp.isnan(am)
        idx = jnp.where(a_val | ((am == cm) & (ai < ci)), ai, ci)
        m = jnp.maximum(am, cm)
        da = jnp.where(as_ > 0, am - m, 0.0)  # finite whenever the part holds any mass
        dc = jnp.where(cs > 0, cm - m, 0.0)
        ea, ec = jnp.where(as_ > 0, jnp.exp(da), 0.0), jnp.where(cs > 0, jnp.exp(dc), 0.0)
        out_s = as_ * ea + cs * ec
        out_u = ea * (au + as_ * da) + ec * (cu + cs * dc)
        inv = [jnp.maximum(x, y) for x, y in zip(ar[n:], cr[n:])]
        sums = [
            jnp.where(as_ > 0, x * jnp.exp(da * w), 0.0)
            + jnp.where(cs > 0, y * jnp.exp(dc * w), 0.0)
            for x, y, w in zip(ar[:n], cr[:n], inv)
        ]
        return (m, idx, out_s, out_u, *sums, *inv)

    ops = (z, ids, one, jnp.zeros_like(z), *([one] * n), *invs)
    f0, i0 = jnp.array(0.0, jnp.float32), jnp.array(0, jnp.int32)
    init = (jnp.array(-jnp.inf, jnp.float32), i0, f0, f0, *([f0] * n), *([f0] * n))
    m, top, s, u, *rest = lax.reduce(ops, init, pick, (1,))
    return m[:, None], top, jnp.log(s) - u / s, rest[:n]


def entropy(logits: jax.Array) -> jax.Array:
    """Shannon entropy in nats of softmax(logits) over the full vocabulary, in float32.

    Args:
      logits: [B, V] raw logits (temperature 1).

    Returns:
      f32 [B].
    """
    return _max_and_entropy(jnp.asarray(logits).astype(jnp.float32))[1]


# ----------------------------------------------------------------------------- ReSET policy


def _check_masks(cfg: ReSET, vocab: int | None) -> None:
    for name in ("nl_mask", "dnl_mask"):
        m = getattr(cfg, name)
        if m is None:
            raise ValueError(
                f"ReSET.{name} is None: build the newline masks with "
                "rejax.text.newline_masks(tokenizer, V) and set them with dataclasses.replace"
            )
        shape, dtype = jnp.shape(m), jnp.result_type(m)
        if len(shape) != 1 or dtype != jnp.bool_ or (vocab is not None and shape[0] != vocab):
            want = f"[{vocab}]" if vocab is not None else "[V]"
            raise ValueError(f"ReSET.{name} must be bool {want}, got {dtype} with shape {shape}")


def _check_state(state: SamplerState, batch: int, window: int | None) -> None:
    if not isinstance(state, SamplerState):
        raise ValueError(f"state must be a SamplerState, got {type(state).__name__}")  # noqa: TRY004
    shape = jnp.shape(state.ring)
    if len(shape) != 2 or shape[0] != batch or (window is not None and shape[1] != window):
        want = f"[{batch}, {window}]" if window is not None else f"[{batch}, w]"
        raise ValueError(
            f"state.ring has shape {shape}, expected {want}: build it with "
            "sampler_init(sampler, batch_size)"
        )


def _row_param(name: str, x: Any, batch: int) -> jax.Array:
    x = jnp.asarray(x, jnp.float32)
    if x.ndim == 0:
        return jnp.broadcast_to(x, (batch,))
    if x.shape != (batch,):
        raise ValueError(f"{name} has shape {x.shape}, expected a scalar or [{batch}]")
    return x


# the per-row hyperparameters of each sampler (scalar or [B]), in the order they are checked
_ROW_FIELDS = {Temperature: ("t", "top_p"), ReSET: ("t_high", "t_low", "tau_0", "top_p")}


def broadcast_rows(sampler: Sampler, batch: int) -> Sampler:
    """`sampler` with each per-row hyperparameter as a float32 [batch] array (Temperature's t and
    top_p; ReSET's t_high, t_low, tau_0 and top_p): the same draws, the same checks.

    A loop that samples every step calls it once before the loop (`rejax.decode.decode_loop`,
    `rejax.slots.decode_chunk`): the steps then hand these arrays to the sampler as they are.
    Scalars broadcast inside the loop body are broadcast again every step, and on a GPU each
    broadcast to more than one row is a kernel of its own (XLA does not hoist broadcasts out of
    a loop).

    Raises:
      ValueError: a hyperparameter that is neither a scalar nor a [batch] vector.
    """
    _check_sampler(sampler)
    name = type(sampler).__name__
    fields = {f: _row_param(f"{name}.{f}", getattr(sampler, f), batch)
              for f in _ROW_FIELDS.get(type(sampler), ())}  # fmt: skip
    return dataclasses.replace(sampler, **fields) if fields else sampler


def _ring_mean(state: SamplerState) -> jax.Array:
    # Recomputed from the buffer (no drift). While the ring still holds the whole response its
    # mean is the running mean, taken from the same incremental sum so that the exact tie
    # H_step == H-bar resolves as in the official code (strict >: confident), not by rounding.
    ring = jnp.sum(state.ring, axis=-1) / jnp.maximum(state.n_ring, 1)
    return jnp.where(state.n_ring == state.g_n, state.g_sum / jnp.maximum(state.g_n, 1), ring)


def _push(h: jax.Array, state: SamplerState) -> SamplerState:
    """The state with entropies h [B] recorded: the ring, the step's and the response's sums."""
    w = state.ring.shape[1]
    slot = jnp.arange(w, dtype=jnp.int32)[None, :] == state.ring_pos[:, None]
    return dataclasses.replace(
        state,
        ring=jnp.where(slot, h[:, None], state.ring),
        n_ring=jnp.minimum(state.n_ring + 1, w),
        ring_pos=(state.ring_pos + 1) % w,
        s_sum=state.s_sum + h,
        s_n=state.s_n + 1,
        g_sum=state.g_sum + h,
        g_n=state.g_n + 1,
    )


def _observe(state: SamplerState, tokens: jax.Array, nl: jax.Array, dnl: jax.Array):
    """The state with tokens i32 [B] observed: a step boundary clears the step's sums."""
    y1, y2 = tokens.astype(jnp.int32), state.y1
    boundary = ends_step(_lookup(nl, y1), _lookup(dnl, y1), _lookup(nl, y2))
    return dataclasses.replace(
        state,
        s_sum=jnp.where(boundary, 0.0, state.s_sum),
        s_n=jnp.where(boundary, 0, state.s_n),
        y1=y1,
        y2=y2,
    )


def _policy(h: jax.Array, state: SamplerState, cfg: ReSET):
    """Temperature for entropies h [B] and the state with h recorded (the official implementation's reference semantics)."""
    b, w = state.ring.shape
    tau_0 = _row_param("ReSET.tau_0", cfg.tau_0, b)
    t_high = _row_param("ReSET.t_high", cfg.t_high, b)
    t_low = _row_param("ReSET.t_low", cfg.t_low, b)
    new = _push(h, state)
    if cfg.include_current:
        # Figure semantics: the window ends at t and both means cover t (H-bar including H_t is
        # our reading; the paper does not say). The step mean takes over at the step's
        # (w+1)-th token, as in the reference semantics.
        ring_mean = _ring_mean(new)
        h_step = jnp.where(new.s_n > w, new.s_sum / new.s_n, ring_mean)
        h_bar = new.g_sum / new.g_n
    else:
        # Reference semantics: estimates from positions < t; at the first token of a response
        # both fall back to H_t, so the step is confident and tau_0 applies.
        ring_mean = _ring_mean(state)
        s_mean = state.s_sum / jnp.maximum(state.s_n, 1)
        h_step = jnp.where(state.s_n >= w, s_mean, jnp.where(state.n_ring > 0, ring_mean, h))
        h_bar = jnp.where(state.g_n > 0, state.g_sum / jnp.maximum(state.g_n, 1), h_step)
    tau = jnp.where(h_step > h_bar, h_step, tau_0)  # SAT (Eq. 1): strict >
    high = h >= tau  # non-strict >= selects T_high
    return jnp.where(high, t_high, t_low), high, new


def _policy_threshold(state: SamplerState, cfg: ReSET) -> tuple[jax.Array, jax.Array]:
    """(thr, alt) f32 [B] with _policy's decision high == (h >= thr) | (h > alt) for every h.

    Reference semantics only (include_current=False), where the estimates come from the state;
    the one case that involves H_t itself (no ring entry and no full step yet) is a first token
    (h_step = h_bar = H_t: tau_0) or, with earlier tokens counted, tau = H_t when H_t > H-bar.
    """
    b, w = state.ring.shape
    tau_0 = _row_param("ReSET.tau_0", cfg.tau_0, b)
    ring_mean = _ring_mean(state)
    s_mean = state.s_sum / jnp.maximum(state.s_n, 1)
    g_mean = state.g_sum / jnp.maximum(state.g_n, 1)
    uses_h = (state.s_n < w) & (state.n_ring == 0)
    h_step = jnp.where(state.s_n >= w, s_mean, ring_mean)
    h_bar = jnp.where(state.g_n > 0, g_mean, h_step)
    tau = jnp.where(h_step > h_bar, h_step, tau_0)
    thr = jnp.where(uses_h, tau_0, tau)
    alt = jnp.where(uses_h & (state.g_n > 0), g_mean, jnp.inf)
    return thr, alt


def reset_temperature(
    logits: jax.Array, state: SamplerState, cfg: ReSET
) -> tuple[jax.Array, jax.Array, SamplerState]:
    """ReSET temperature for the next token, recording its entropy in the state.

    Args:
      logits: [B, V] raw logits (temperature 1).
      state: the `SamplerState` of these rows (window cfg.window).
      cfg: the `ReSET` sampler (masks not needed here).

    Returns:
      (temperature f32 [B], entropy f32 [B] in nats, state with the entropy pushed).
    """
    logits = _check_logits(logits)
    _check_state(state, logits.shape[0], cfg.window)
    h = entropy(logits)
    temperature, _, state = _policy(h, state, cfg)
    return temperature, h, state


def _lookup(mask: jax.Array, ids: jax.Array) -> jax.Array:
    inside = (ids >= 0) & (ids < mask.shape[0])
    return inside & mask[jnp.clip(ids, 0, mask.shape[0] - 1)]


def reset_observe(state: SamplerState, tokens: jax.Array, cfg: ReSET) -> SamplerState:
    """Record the tokens just generated; a step boundary clears the in-step sums.

    A new step starts after a token that ends one by `rejax.text.ends_step` (the paper's step
    rule: a double-newline token, or two single-newline tokens in a row); the boundary token
    itself belongs to the old step.

    Args:
      state: the `SamplerState` after `reset_temperature` for this position.
      tokens: i32 [B] the generated ids.
      cfg: the `ReSET` sampler with its masks set.

    Returns:
      The updated state.
    """
    _check_masks(cfg, None)
    b = state.y1.shape[0]
    tokens = jnp.asarray(tokens)
    if tokens.shape != (b,) or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"tokens must be an int [{b}] vector, got {tokens.dtype}{tokens.shape}")
    return _observe(state, tokens, jnp.asarray(cfg.nl_mask), jnp.asarray(cfg.dnl_mask))


# ----------------------------------------------------------------------------- top-p


def _masses(probs: jax.Array) -> jax.Array:
    # Exact integer masses: p <= 1 gives q <= 2**30, and sum(q) < 2**31 for V < 2**30.
    return jnp.round(probs * float(1 << _MASS_BITS)).astype(jnp.int32)


def _keep_limit(q: jax.Array, top_p: jax.Array) -> jax.Array:
    # A token is kept iff f32(mass ranked above it) < f32(top_p) * f32(total mass), i.e. the
    # ascending inclusive cumulative mass is > (1 - top_p) * total (vLLM). Monotone in the
    # mass, so every method can evaluate it on exact integer sums.
    return top_p * jnp.sum(q, axis=-1).astype(jnp.float32)


def _top_p_sort(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    # The definition: full stable ascending sort, inclusive cumulative mass.
    b, v = probs.shape
    q = _masses(probs)
    limit = _keep_limit(q, top_p)
    order = jnp.argsort(probs, axis=-1, stable=True)
    incl = jnp.cumsum(jnp.take_along_axis(q, order, axis=-1), axis=-1)
    above = incl[:, -1:] - incl  # mass of the tokens ranked above each sorted position
    keep_sorted = above.astype(jnp.float32) < limit[:, None]
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, v), jnp.bool_).at[rows, order].set(keep_sorted)


def _select_bits(count_not_kept, lo: jax.Array, bits: int, radix: int) -> jax.Array:
    """Largest x in [lo, lo + 2**bits) with count_not_kept-predicate true, `radix` bits a pass.

    count_not_kept(t [B, J]) -> i32 [B]: how many thresholds t[:, j] are not yet "kept"; the
    predicate is monotone (false above some x), and it must hold at x = lo.
    """
    off = jnp.zeros_like(lo)
    done = 0
    while done < bits:
        d = min(radix, bits - done)
        shift = bits - done - d
        j = jnp.arange(1, 1 << d, dtype=jnp.int32)
        thresholds = (lo + off)[:, None] + (j << shift)[None, :]
        off = off + (count_not_kept(thresholds) << shift)
        done += d
    return lo + off


def _top_p_radix(probs: jax.Array, top_p: jax.Array, radix: int = _RADIX_BITS) -> jax.Array:
    # Exact selection without sorting: find the boundary probability by a most-significant-digit
    # search over float32 bit patterns (ordered like the values for p >= 0), each pass counting
    # the exact mass above 2**radix - 1 thresholds (28 / radix passes over V). Tokens tied at the
    # boundary probability are then cut by id: how many to keep is a scalar bisection, which ones
    # a running count over V (the higher ids rank above, as in a stable ascending sort).
    b, v = probs.shape
    # Materialise the probabilities once: each pass then reads them instead of recomputing
    # exp() for every threshold (XLA would otherwise fuse the softmax into all passes).
    probs = lax.optimization_barrier(probs)
    q = _masses(probs)
    limit = _keep_limit(q, top_p)
    key = lax.bitcast_convert_type(probs, jnp.int32)

    def kept(mass_above, lim):  # exact integer masses ranked above a token -> is it kept
        return mass_above.astype(jnp.float32) < lim

    def value_pass(t):  # t [B, J] key thresholds -> how many of them still drop their token
        above = jnp.sum(jnp.where(key[:, None, :] > t[:, :, None], q[:, None, :], 0), axis=-1)
        return jnp.sum(~kept(above, limit[:, None]), axis=-1, dtype=jnp.int32)

    # x = the largest key whose strictly-greater mass still drops it; the boundary key is x + 1
    # (it carries mass, so x + 1 <= bits of 1.0). At _KEY_LO the mass above is the total.
    lo = jnp.full((b,), _KEY_LO, jnp.int32)
    k_b = _select_bits(value_pass, lo, _KEY_BITS, radix) + 1
    above_b = key > k_b[:, None]
    tie = key == k_b[:, None]
    g0 = jnp.sum(jnp.where(above_b, q, 0), axis=-1)  # mass strictly above the tied tokens
    n_tie = jnp.sum(tie, axis=-1, dtype=jnp.int32)
    q_b = _masses(lax.bitcast_convert_type(k_b, jnp.float32))  # every tied token's mass
    # n_keep = #{j in [0, n_tie): kept(g0 + j q_b)}, a prefix of j (j = 0 is kept): bisection
    j = jnp.zeros((b,), jnp.int32)
    for bit in reversed(range(max(1, math.ceil(math.log2(v + 1))))):
        cand = j + (1 << bit)
        ok = (cand < n_tie) & kept(g0 + jnp.minimum(cand, n_tie) * q_b, limit)
        j = jnp.where(ok, cand, j)
    n_keep = j + 1
    ties_above = n_tie[:, None] - jnp.cumsum(tie, axis=-1, dtype=jnp.int32)
    return above_b | (tie & (ties_above < n_keep[:, None]))


def _top_p_candidates(probs: jax.Array, top_p: jax.Array):
    # The k = min(16, V) most likely tokens in rank order and their exact keep decisions, valid
    # for a row when `covered`: the nucleus then lies inside the candidates. top_k may split the
    # tie group at the k-th value v_k either way, so a candidate's mass ranked above is known
    # exactly only above v_k and at the first v_k candidate (everything above it is a candidate;
    # whichever v_k token truly ranks first has that same mass above it). A row is covered when
    # such an exact candidate is dropped (so is everything ranked below it), when v_k = 0 (every
    # token outside has probability 0: dropped unless top_p = 1, and never drawn), or if k = V.
    v = probs.shape[1]
    k = min(_TOPK_FAST, v)
    vals, idx = lax.top_k(probs, k)
    # rank order: probability descending, the higher id first among ties (module docstring)
    _, _, idx = lax.sort((-vals, -idx, idx), dimension=-1, num_keys=2)
    vals = jnp.take_along_axis(probs, idx, axis=-1)
    q = _masses(vals)
    limit = _keep_limit(_masses(probs), top_p)  # the one pass over V besides top_k
    above = jnp.cumsum(q, axis=-1) - q
    kept = (above.astype(jnp.float32) < limit[:, None]) | (top_p >= 1.0)[:, None]
    v_k = vals[:, -1:]
    at_v_k = vals == v_k
    exact = (vals > v_k) | (at_v_k & (jnp.cumsum(at_v_k, axis=-1) == 1))
    covered = jnp.any(~kept & exact, axis=-1) | (v_k[:, 0] == 0.0) | (k == v)
    return idx, vals, kept, covered


def _top_p_topk(probs: jax.Array, top_p: jax.Array) -> jax.Array:
    b, v = probs.shape
    idx, _, kept, covered = _top_p_candidates(probs, top_p)
    rows = jnp.arange(b)[:, None]
    fast = jnp.zeros((b, v), jnp.bool_).at[rows, idx].set(kept)
    slow = lax.cond(
        jnp.any(~covered),
        lambda: _top_p_radix(probs, top_p),
        lambda: jnp.zeros((b, v), jnp.bool_),
    )
    return jnp.where(covered[:, None], fast, slow)


def top_p_mask(probs: jax.Array, top_p: Any, method: str = MASK_METHOD) -> jax.Array:
    """The tokens top-p sampling keeps (vLLM semantics, exact integer masses; module doc).

    Args:
      probs: f32 [B, V] probabilities (rows sum to ~1; zeros allowed).
      top_p: scalar or [B] in (0, 1]; 1.0 keeps every token.
      method: "topk" (16 candidates, "radix" for rows whose nucleus is larger), "radix"
        (selection by bit-pattern search, no sort) or "sort" (full sort, the definition). All
        give the same set.

    Returns:
      bool [B, V].
    """
    _check_method(method, TOP_P_METHODS)
    probs = jnp.asarray(probs)
    if probs.ndim != 2:
        raise ValueError(f"probs must be [B, V], got shape {probs.shape}")
    top_p = _row_param("top_p", top_p, probs.shape[0])
    probs = probs.astype(jnp.float32)
    fn = {"topk": _top_p_topk, "radix": _top_p_radix, "sort": _top_p_sort}[method]
    return fn(probs, top_p) | (top_p >= 1.0)[:, None]


def _check_method(method: Any, allowed: tuple[str, ...] = SAMPLE_METHODS) -> None:
    if method not in allowed:
        raise ValueError(f"top-p method={method!r} is invalid: expected one of {allowed}")


# ----------------------------------------------------------------------------- top-k


def _kth_largest(x: jax.Array, k: int) -> jax.Array:
    """f32 [B]: the k-th largest entry of each row of x [B, V], counted with multiplicity.

    k <= 16 is one `lax.top_k`. Larger k takes ceil(k / 16) rounds of 16: a round's 16th value a
    is the answer if the rank sought falls among the entries >= a (a count over V), and otherwise
    the next round searches the entries < a for the remaining rank.
    """
    b, v = x.shape
    assert 1 <= k <= v, (k, v)
    if k <= _TOPK_FAST:
        return lax.top_k(x, k)[0][:, -1]
    need = jnp.full((b,), k, jnp.int32)  # rank still sought among the entries of `cur`
    answer = jnp.zeros((b,), x.dtype)
    found = jnp.zeros((b,), jnp.bool_)
    cur = x
    for r in range(-(-k // _TOPK_FAST)):
        top = lax.top_k(cur, _TOPK_FAST)[0]  # [B, 16] descending
        here = jnp.take_along_axis(top, jnp.clip(need - 1, 0, _TOPK_FAST - 1)[:, None], -1)[:, 0]
        a = top[:, -1]
        answer = jnp.where(~found & (need <= _TOPK_FAST), here, answer)
        found = found | (need <= _TOPK_FAST)
        if (r + 1) * _TOPK_FAST >= k:
            break  # need <= k - 16 r <= 16 now: this round decided every row
        n_ge = jnp.sum(cur >= a[:, None], axis=-1, dtype=jnp.int32)
        answer = jnp.where(~found & (need <= n_ge), a, answer)
        found = found | (need <= n_ge)
        need = need - n_ge
        cur = jnp.where(cur < a[:, None], cur, -jnp.inf)
    return answer


# ----------------------------------------------------------------------------- sample


def _check_logits(logits: Any) -> jax.Array:
    logits = jnp.asarray(logits)
    if logits.ndim != 2 or not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(
            f"logits must be float [B, V], got {logits.dtype} with shape {logits.shape}"
        )
    return logits


def _check_sampler(sampler: Any) -> None:
    if not isinstance(sampler, (Greedy, Temperature, ReSET)):
        raise ValueError(  # noqa: TRY004
            "sampler must be Greedy(), Temperature(...) or ReSET(...), "
            f"got {type(sampler).__name__}"
        )


def _row_keys(key: jax.Array, batch: int) -> jax.Array:
    """[B] typed keys: a single key is split per row; a [B] batch of keys is used as given."""
    key = jnp.asarray(key) if not isinstance(key, jax.Array) else key
    typed = jnp.issubdtype(key.dtype, jax.dtypes.prng_key)
    if not typed:
        if key.dtype != jnp.uint32 or key.ndim not in (1, 2) or key.shape[-1] != 2:
            raise ValueError(
                f"key must be a jax.random key (or uint32 [2] / [B, 2]), got "
                f"{key.dtype} with shape {key.shape}"
            )
        key = jax.random.wrap_key_data(key)
    if key.ndim == 0:
        return jax.random.split(key, batch)
    if key.shape != (batch,):
        raise ValueError(f"key has batch shape {key.shape}, expected () or ({batch},)")
    return key


def _kernel_serves(sampler: Sampler) -> bool:
    """Whether method "kernel" runs `sampler` through the fused op (else through "radix")."""
    if isinstance(sampler, Temperature):
        return True
    return isinstance(sampler, ReSET) and not sampler.include_current


def _safe_t(t: jax.Array) -> jax.Array:
    return jnp.where(t <= GREEDY_EPS, 1.0, t)  # greedy rows: any finite scale, result unused


def _gumbel_of_bits(hi: jax.Array, lo8: jax.Array) -> jax.Array:
    """f32 Gumbel noise of 40 random bits: a uint32 word `hi` and a byte `lo8` (uint32 < 256).

    u = (hi * 2**8 + lo8 + 1/2) / 2**40 is uniform in (0, 1) and the noise is -log(E) with the
    exponential E = -log(1 - u). Each end is computed from the half of u's range nearer to it,
    so nothing is lost to rounding u near 1: x = min(u, 1 - u) (the complement is the bitwise
    one of the 40 bits) and E = -log1p(-x) for u < 1/2, -log(x) otherwise. The noise spans
    [-log(41 log 2), 41 log 2] = [-3.35, 28.42], and P(noise > t) is off by float32 rounding
    (relative ~1e-6) plus at most one step 2**-40 of u's grid.
    """
    upper = hi >= jnp.uint32(1 << 31)
    a = jnp.where(upper, ~hi, hi)  # < 2**31
    c = jnp.where(upper, jnp.uint32(255) - lo8, lo8)
    x = a.astype(jnp.float32) * jnp.float32(2.0**-32) + (
        c.astype(jnp.float32) + jnp.float32(0.5)
    ) * jnp.float32(2.0**-40)  # in (0, 1/2]
    e = jnp.where(upper, -jnp.log(x), -jnp.log1p(-x))
    return -jnp.log(e)


def _gumbel(key: jax.Array, n: int) -> jax.Array:
    """f32 [n] standard Gumbel noise under one key: `_gumbel_of_bits` of token j's own word
    (word j of `jax.random.bits(key, (n + ceil(n / 4),))`) and byte j % 4 of word n + j // 4.

    float32 noise from 23-bit uniforms (`jax.random.gumbel`'s default) tops out at 15.9, which
    halves the share of ~1e5 tokens each ~1e-7 of the top one; these 40 bits reach 28.4.
    """
    m = -(-n // 4)
    w = jax.random.bits(key, (n + m,), jnp.uint32)
    shifts = jnp.arange(0, 32, 8, dtype=jnp.uint32)
    lo8 = ((w[n:, None] >> shifts) & jnp.uint32(0xFF)).reshape(-1)[:n]
    return _gumbel_of_bits(w[:n], lo8)


def _draw(keys: jax.Array, zt: jax.Array, keep: jax.Array) -> jax.Array:
    # Gumbel-max over the kept tokens: an exact draw from softmax(zt) restricted to `keep`.
    g = jax.vmap(lambda k: _gumbel(k, zt.shape[-1]))(keys)
    return jnp.argmax(jnp.where(keep & (zt > -jnp.inf), zt + g, -jnp.inf), axis=-1)


def _draw_topk(keys: jax.Array, zt: jax.Array, probs: jax.Array, top_p: jax.Array) -> jax.Array:
    # Covered rows draw among their 16 candidates; the others take the radix mask and a draw
    # over V, computed only when some row needs them. Which path a row takes depends on its own
    # logits and top_p only, so rows stay independent and each path is an exact draw.
    b, v = probs.shape
    idx, vals, kept, covered = _top_p_candidates(probs, top_p)
    zk = jnp.take_along_axis(zt, idx, axis=-1)
    g = jax.vmap(lambda k: _gumbel(k, idx.shape[-1]))(keys)
    j = jnp.argmax(jnp.where(kept & (vals > 0.0), zk + g, -jnp.inf), axis=-1)
    fast = jnp.take_along_axis(idx, j[:, None], axis=-1)[:, 0]

    def slow():
        # rows with top_p = 1 need no mask, only the draw over V
        keep = lax.cond(
            jnp.any(~covered & (top_p < 1.0)),
            lambda: _top_p_radix(probs, top_p) | (top_p >= 1.0)[:, None],
            lambda: jnp.ones((b, v), jnp.bool_),
        )
        return _draw(keys, zt, keep).astype(jnp.int32)

    drawn = lax.cond(jnp.any(~covered), slow, lambda: jnp.zeros((b,), jnp.int32))
    return jnp.where(covered, fast, drawn)


def _sample_tempered(
    keys: jax.Array,
    logits: jax.Array,
    m: jax.Array,
    top: jax.Array,
    t: jax.Array,
    top_p: jax.Array,
    top_k: int,
    method: str,
    denom: jax.Array | None = None,
) -> jax.Array:
    # softmax((z - m) / t) shares the raw row max m (t > 0), then top-k, top-p, and a Gumbel-max
    # draw over the kept tokens; rows with t <= GREEDY_EPS take the raw argmax `top`. `denom`
    # [B], if given, is the softmax denominator sum(exp((z - m) / t)) computed earlier.
    greedy = t <= GREEDY_EPS
    zt = (logits - m) / _safe_t(t)[:, None]
    if top_k:
        zt = jnp.where(zt >= _kth_largest(zt, top_k)[:, None], zt, -jnp.inf)
    e = jnp.exp(zt)
    if denom is None:
        denom = jnp.sum(e, axis=-1)
    probs = e / denom[:, None]
    if method == "topk":
        drawn = _draw_topk(keys, zt, probs, top_p)
    else:
        drawn = _draw(keys, zt, top_p_mask(probs, top_p, method))
    return jnp.where(greedy, top, drawn).astype(jnp.int32)


def _reference_tempered(
    logits, thr, alt, t_a, t_b, top_p, keys, *, kind: str, top_k: int, stats_method: str
):
    """The reference of `rejax.ops.sampler.sample_top_p`: (tokens, entropy, temperature) [B].

    Row temperature t_a if h >= thr or h > alt, else t_b; exactly `sample`'s "radix" path
    (same statistics, denominators and random numbers).
    """
    temps = [_safe_t(t_a), _safe_t(t_b)] if kind == "reset" else [_safe_t(t_a)]
    if top_k:
        temps = []  # top-k changes the denominator: _sample_tempered sums it
    if stats_method == "online":
        m, top, h, denoms = _online_stats(logits, tuple(1.0 / x for x in temps))
    else:
        m, h, top = _max_and_entropy(logits)
        d = logits - m
        if kind == "reset":
            denoms = [jnp.sum(jnp.exp(d / x[:, None]), axis=-1) for x in temps]
        else:
            denoms = [None]
    high = (h >= thr) | (h > alt)
    t = jnp.where(high, t_a, t_b)
    if kind == "reset":
        denom = jnp.where(high, denoms[0], denoms[1])
    else:
        denom = denoms[0] if denoms else None
    tokens = _sample_tempered(keys, logits, m, top, t, top_p, top_k, "radix", denom)
    return tokens, h, t


def _sample_kernel(keys, logits, state, sampler, stats_method, variant=None, impl="auto",
                   step=None):  # fmt: skip
    # the fused op (rejax.ops.sampler): Temperature, and ReSET in reference semantics;
    # variants sampler_op.STATE_VARIANTS: "grid" / "cdf" with ReSET's state update in the op
    b = logits.shape[0]
    variant = variant or sampler_op.VARIANT
    # "auto" runs ReSET's state update in the launch wherever it picks "grid" or "cdf" (the
    # same tokens and state; see sampler_op.STATE_VARIANT)
    chosen = sampler_op.choose_variant(variant, b) if variant == "auto" else None
    state_in_op = variant in sampler_op.STATE_VARIANTS or (
        isinstance(sampler, ReSET) and chosen in sampler_op.kernels.GRID_VARIANTS
    )
    draw = sampler_op.STATE_VARIANTS.get(variant, chosen or "grid")
    if state_in_op:
        variant = draw
    opts = {"stats_method": stats_method, "variant": variant, "impl": impl, "step": step}
    if isinstance(sampler, Temperature):
        t = _row_param("Temperature.t", sampler.t, b)
        top_p = _row_param("Temperature.top_p", sampler.top_p, b)
        thr, alt = jnp.full((b,), -jnp.inf), jnp.full((b,), jnp.inf)
        tokens, h, t = sampler_op.sample_top_p(
            logits, thr, alt, t, t, top_p, keys, kind="temperature", top_k=sampler.top_k, **opts
        )
        return tokens, state, {"entropy": h, "temperature": t}
    thr, alt = _policy_threshold(state, sampler)
    t_high = _row_param("ReSET.t_high", sampler.t_high, b)
    t_low = _row_param("ReSET.t_low", sampler.t_low, b)
    top_p = _row_param("ReSET.top_p", sampler.top_p, b)
    if state_in_op:
        nl, dnl = jnp.asarray(sampler.nl_mask), jnp.asarray(sampler.dnl_mask)
        tokens, h, t, state = sampler_op.sample_reset_step(
            logits, thr, alt, t_high, t_low, top_p, keys, state, nl, dnl, impl=impl,
            stats_method=stats_method, variant=draw, step=step,
        )  # fmt: skip
        return tokens, state, {"entropy": h, "temperature": t}
    tokens, h, t = sampler_op.sample_top_p(
        logits, thr, alt, t_high, t_low, top_p, keys, kind="reset", **opts
    )
    _, _, state = _policy(h, state, sampler)
    state = reset_observe(state, tokens, sampler)
    return tokens, state, {"entropy": h, "temperature": t}


def sample(
    key: jax.Array,
    logits: jax.Array,
    state: SamplerState,
    sampler: Sampler,
    *,
    top_p_method: str | None = None,
    stats_method: str = STATS_METHOD,
    step: jax.Array | None = None,
) -> tuple[jax.Array, SamplerState, dict]:
    """Draw the next token of every row.

    Greedy takes the argmax of the raw logits. Temperature scales by 1/t, applies top-k and
    top-p, and samples. ReSET computes its temperature from the raw entropy and its state
    (`reset_temperature`), samples as Temperature does with top-p, and records the tokens
    (`reset_observe`). A temperature <= 1e-6 means greedy.

    Args:
      key: a jax.random key (split per row) or a [B] batch of keys (row i uses key[i], so a row
        samples the same token in any batch). Fold the step in with `step=` (the same draws
        as `jax.random.fold_in(key, step)` before the call).
      logits: [B, V] raw logits (cast to float32; the "kernel" methods read bfloat16 logits
        as they are, the same values).
      state: `SamplerState` from `sampler_init(sampler, B)`; returned unchanged unless ReSET.
      sampler: Greedy(), Temperature(...) or ReSET(...).
      top_p_method: one of `SAMPLE_METHODS`, overriding the sampler's own `top_p_method`
        (None: the sampler's). (The same kept set; "topk" draws with other random
        numbers than "radix" and "sort" do, and so does "kernel" on a GPU, so tokens differ
        for the same key; "kernel" off a GPU, or for ReSET with include_current=True, is
        "radix"; "kernel-split", "kernel-cluster", "kernel-merge", "kernel-reject" and
        "kernel-grid" name the kernels' variant, the same distribution and random numbers;
        "kernel-cdf" draws from the same distribution with other random numbers;
        "kernel-grid-state" / "kernel-cdf-state" are "kernel-grid" / "kernel-cdf" with ReSET's
        state update in the kernel's launch, the same tokens and state; "kernel" runs
        "kernel-cdf-state" for ReSET). Static.
      stats_method: "two_pass" (a max pass, then one pass for the entropy's sums and the
        softmax denominators) or "online" (all of them in one rescaling reduction; the same
        values up to float rounding). Static.
      step: None, or an int scalar / [B]: row i samples with fold_in(key[i], step[i]) (the
        same tokens as folding before the call; the "kernel" methods' grid kernels fold it in
        their launch instead of an XLA kernel before it, the others fold first).

    Returns:
      (tokens i32 [B], state, info) with info = {"entropy": f32 [B] raw T=1 entropy in nats,
      "temperature": f32 [B] the temperature applied (0 for Greedy)}.
    """
    _check_sampler(sampler)
    if top_p_method is None:
        top_p_method = getattr(sampler, "top_p_method", TOP_P_METHOD)
    _check_method(top_p_method)
    if stats_method not in STATS_METHODS:
        raise ValueError(
            f"stats_method={stats_method!r} is invalid: expected one of {STATS_METHODS}"
        )
    raw = _check_logits(logits)
    logits = raw.astype(jnp.float32)  # exact for bfloat16 and float16
    b, v = logits.shape
    _check_state(state, b, sampler.window if isinstance(sampler, ReSET) else None)
    if isinstance(sampler, Temperature) and sampler.top_k > v:
        raise ValueError(f"Temperature.top_k={sampler.top_k} exceeds the vocabulary V={v}")
    if isinstance(sampler, ReSET):
        _check_masks(sampler, v)
    keys = _row_keys(key, b)
    if step is not None:
        step = sampler_op._step_operand(step, b)  # int32 [1] or [B] (checked before any work)
    if top_p_method in KERNEL_METHODS:
        if _kernel_serves(sampler):
            variant = KERNEL_METHODS[top_p_method]
            # the op reads bfloat16 logits as they are (their float32 values: the same draws)
            return _sample_kernel(keys, raw, state, sampler, stats_method, variant, step=step)
        top_p_method = "radix"  # what the op's reference computes
    if step is not None:  # the other methods fold in XLA (the same keys)
        impl_name = str(jax.random.key_impl(keys))
        data = sampler_op._fold_step(jax.random.key_data(keys), step, impl_name)
        keys = jax.random.wrap_key_data(data, impl=impl_name)
    # the temperatures whose softmax denominators the statistics pass can provide
    if isinstance(sampler, Temperature):
        t = _row_param("Temperature.t", sampler.t, b)
        temps = [_safe_t(t)] if sampler.top_k == 0 else []  # top-k changes the denominator
    elif isinstance(sampler, ReSET):
        t_hi = _safe_t(_row_param("ReSET.t_high", sampler.t_high, b))
        t_lo = _safe_t(_row_param("ReSET.t_low", sampler.t_low, b))
        temps = [t_hi, t_lo]
    else:
        temps = []
    if stats_method == "online":
        m, top, h, denoms = _online_stats(logits, tuple(1.0 / x for x in temps))
    else:
        m, h, top = _max_and_entropy(logits)
        # ReSET's two denominators are sibling reductions of the entropy's sums (the same pass
        # over V); Temperature's is summed in _sample_tempered, next to its probabilities
        d = logits - m
        if isinstance(sampler, ReSET):
            denoms = [jnp.sum(jnp.exp(d / x[:, None]), axis=-1) for x in temps]
        else:
            denoms = [None] * len(temps)
    if isinstance(sampler, Greedy):
        return top, state, {"entropy": h, "temperature": jnp.zeros((b,), jnp.float32)}
    if isinstance(sampler, Temperature):
        top_p = _row_param("Temperature.top_p", sampler.top_p, b)
        denom = denoms[0] if denoms else None
        tokens = _sample_tempered(keys, logits, m, top, t, top_p, sampler.top_k, top_p_method,
                                  denom)  # fmt: skip
        return tokens, state, {"entropy": h, "temperature": t}
    top_p = _row_param("ReSET.top_p", sampler.top_p, b)
    t, high, state = _policy(h, state, sampler)
    denom = jnp.where(high, denoms[0], denoms[1])
    tokens = _sample_tempered(keys, logits, m, top, t, top_p, 0, top_p_method, denom)
    state = reset_observe(state, tokens, sampler)
    return tokens, state, {"entropy": h, "temperature": t}
