"""The fused sampler op: temperature (or ReSET's choice of two) + exact top-p + the draw.

`sample_top_p(logits, thr, alt, t_a, t_b, top_p, keys)` draws one token per row from
softmax((z - m) / t) restricted to the top-p nucleus (rejax.sampling's exact integer-mass
definition), where the row's temperature is t_a when its raw entropy h satisfies
h >= thr or h > alt and t_b otherwise (Temperature: thr = -inf, so always t_a; ReSET: thr and
alt encode the policy's threshold, `rejax.sampling._policy_threshold`). It returns the tokens,
h and the temperature used.

* Every platform lowers the primitive to its reference: rejax.sampling's "radix" path
  (`rejax.sampling._reference_tempered`), so CPU results are those of that method.
* The `platform="cuda"` lowering asks `rejax.ops._dispatch.use_kernel`: the kernels of
  `cuda_ops/sampler.cu` as `__gpu$xla.gpu.ptx` custom calls, or else the reference. `variant`
  picks them (`VARIANTS`, or "auto", the default: `choose_variant` takes "cdf" for top-p
  alone, "grid" for top-k up to 20, above it "merge" where it measured faster, else "split"):
  "split", three kernels (statistics;
  top-p histogram; boundary resolution, each one multi-block pass over the row with a
  last-block combine);
  "cluster", one kernel in which a cluster of 8 CTAs per row combines through distributed
  shared memory (one launch, no global scratch); "merge", "split" where top-k (k <= 32)
  draws in the histogram kernel from candidates each block lists (the same tokens as "split");
  "reject", "cluster" that first takes the Gumbel-max over every token and keeps it when the
  keep rule does (then it is the Gumbel-max over the kept tokens: "cluster"'s token), running
  the histogram path only for a rejected draw (top-p < 1 without top-k);
  "grid", "reject"'s first draw and keep test in one launch over a grid of CTAs per row that
  meet at barriers in global scratch (every SM at one row); it tests the 4 best-scoring draws
  together and takes the best kept one, and if all are rejected climbs the rank order (the best
  score among the tokens ranked above them, tested again) until one is kept; with top-k it lists
  the tokens at or above the k-th largest of the CTAs' published thread maxima (a superset of
  the top-k set) and draws from that list in one CTA;
  "cdf" (opt-in), "grid" whose first 4 draws come from the inverse CDF of the tokens' weights
  (integer prefix sums in vocabulary order, no noise sweep; `cdf_draws`), the first kept one
  the token, all rejected "grid"'s climb; with top-k it is "grid".
  All but "cdf" draw with the same random numbers (a
  Gumbel-max over the kept tokens with Philox-4x32-10 noise keyed by the row's key and the token
  id, 55 bits a token as `gumbel_of_bits` maps them), so tokens differ from the reference's for
  the same key while the distribution is the same; "cdf" draws its own tokens from the same
  distribution.

`step=` (both ops): the keys are the rows' base keys and row r draws with
fold_in(keys[r], step[r]) (step () or [B] int32), the same bits as folding before the call;
"grid" / "cdf" fold in their launch (`threefry_fold_in`, threefry keys), which spares a decode
loop the fold's XLA kernel every step; every other path folds in XLA first.

`sample_kernel` is `rejax.sampling.sample`'s kernel path with the variant as an argument (the
GPU tests and experiments/bench_sampler.py reach every variant through it).

`emulate` is a NumPy mirror of the kernels' algorithm (the same bins, boundary search, whole-bin
test, collection and large-bin paths, pruning and noise) that the CPU tests check against the
definition; both variants run that algorithm (the cluster kernel with `chunks=8` statistics and
its own, tighter, pruning: `prune="bound"`).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import batching, mlir

from cuda_ops import sampler as kernels
from rejax.ops import _dispatch

OP = "sample_top_p"
KINDS = ("temperature", "reset")
GREEDY_EPS = 1e-6
VARIANTS = kernels.VARIANTS  # "split" (three kernels), "cluster", "reject", "grid" (one), "merge"
# "auto" (the default) picks a variant per call by the batch rows and top-k (`choose_variant`):
# "cdf" for top-p alone (Temperature, ReSET), "grid" for top-k up to GRID_TOPK_MAX_K, "merge"
# or "split" for a larger k. Every variant but "cdf" draws the same tokens up to the float
# rounding of the row statistics ("cdf": the same distribution, its own tokens, the same for any
# batch). "cluster" and "reject" are opt-in. Every variant reads float32 or bfloat16 logits
# (`LOGITS_DTYPES`: bfloat16 ones as their float32 values, so the same draws from half the
# bytes; the decode loop carries a bfloat16 head's logits as they are).
VARIANT = "auto"
VARIANT_CHOICES = ("auto", *VARIANTS)
# "grid" with ReSET's state update in the same launch (`sample_reset_step`; Temperature runs
# "grid"): the ReSET policy's state update after the draw (about 8 small XLA kernels a step)
# becomes part of the kernel, which updates the state in place (`STATE_ALIASES`). "auto" runs
# it for ReSET wherever it picks "grid" or "cdf" ("cdf-state"). H200, 2-layer decode step at 1 row (profile_step,
# experiments/results/h200_u/): busy 446.0 us against 453.7 for ReSET on "grid" and 439.9 for
# Temperature; 36-layer decode loop at 64 rows: +136 against +151 us over greedy.
STATE_VARIANT = "grid-state"
# every variant with the state update in its launch -> the draw variant it runs
STATE_VARIANTS = {"grid-state": "grid", "cdf-state": "cdf"}
# Kernel alone on the H200 (experiments/bench_sampler.py --logits lm, us over greedy, split /
# merge; experiments/results/h200_l/): Temperature + top-p 16.3 / 17.4 at 1 row, 33.0 / 28.4 at
# 8, 114.2 / 90.4 at 64; ReSET + top-p 30.7 / 31.6, 39.8 / 32.4, 135.0 / 105.2; top-k 20
# 27.1 / 31.4, 46.7 / 50.4 at 16, 62.0 / 54.0 at 32, 112.2 / 95.6 at 64. So "auto" takes
# "merge" from MERGE_MIN_ROWS_TOPK rows for a merged top-k (k <= kernels.MERGE_MAX_K) above
# GRID_TOPK_MAX_K.
# "grid" (one launch over a grid of CTAs per row), same run against "reject" / "merge"
# (experiments/results/h200_t/, us over greedy): Temperature + top-p 10.7 / 20.7 / 15.3 at 1
# row, 24.0 / 22.2 / 28.6 at 8, 79.6 / 96.5 / 90.6 at 64; ReSET + top-p 22.0 / 27.9 / 33.1,
# 26.4 / 31.1 / 32.3, 98.1 / 109.8 / 103.3. So "auto" takes "grid" for top-p alone.
# "grid" with its own top-k (the k-th largest of the CTAs' published maxima, a listed superset
# of the top-k set), against "merge" / "split", same run, lm logits, top-p 0.95
# (experiments/results/h200_v/, us over greedy): top-k 20: 19.2 / 29.6 / 24.1 at 1 row, 23.7 /
# 45.2 / 40.0 at 8, 66.5 / 92.6 / 109.7 at 64. Top-k 64, grid / split: 43.8 / 26.7 at 1 row,
# 45.0 / 41.8 at 8, 482.6 / 115.7 at 64 (4 CTAs a row publish 32 maxima < k, so CTA 0 selects
# over the whole vocabulary). So "auto" takes "grid" up to GRID_TOPK_MAX_K (Qwen3's
# recommended 20) and the earlier choice above it.
GRID_TOPK_MAX_K = 20
MERGE_MIN_ROWS_TOPK = 32
# "cdf" ("grid" drawing by the inverse CDF: no noise sweep) against "grid", same run, H200,
# kernel alone, us over greedy, lm / flat logits (experiments/results/cdf_s47/; its first build,
# with weights relative to each chunk's max, at 3eb414b): Temperature + top-p 16.4 / 18.7
# against 16.6 / 17.1 at 1 row, 24.3 / 25.5 against 28.4 / 31.7 at 8, 35.0 / 34.1 against 48.6 /
# 54.8 at 32, 55.7 / 56.5 against 80.9 / 91.5 at 64; ReSET + top-p 25.5 / 28.8 against 19.9 /
# 27.3 at 1 row, 28.7 / 27.9 against 29.6 / 32.5 at 8, 76.1 / 64.7 against 101.0 / 96.7 at 64.
# In the 36-layer decode loop at 64 rows: Temperature +69 / +69 us over greedy against +80 /
# +107, ReSET (state in the launch) +71 / +69 against +103 / +103; at 1 row a tie (+13 / +15
# against +14 / +14). So "auto" takes "cdf" for top-p alone at every batch (one variant for all
# batches: a row draws the same token in any batch). The build here (weights relative to the row
# max, one barrier more, the same draws for every plan) is to pass its GPU tests before this
# lands (experiments/results/s48/).


def choose_variant(variant: str, batch: int, top_k: int = 0) -> str:
    """The kernel variant a call runs: `variant` itself, or for "auto" "cdf" for top-p alone,
    "grid" for top-k up to `GRID_TOPK_MAX_K`, and for a larger k "merge" where it measured faster
    (k <= `kernels.MERGE_MAX_K` from `MERGE_MIN_ROWS_TOPK` rows) and "split" elsewhere."""
    if variant not in VARIANT_CHOICES:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANT_CHOICES}")
    if variant != "auto":
        return variant
    if top_k == 0:
        return "cdf"
    if top_k <= GRID_TOPK_MAX_K:
        return "grid"
    if top_k <= kernels.MERGE_MAX_K:
        return "merge" if batch >= MERGE_MIN_ROWS_TOPK else "split"
    return "split"


# ----------------------------------------------------------------------------- primitive

_sample_p = Primitive("rejax_sample_top_p")
_sample_p.multiple_results = True


def _fold_step(keys, step, key_impl: str):
    """Key data [B, 2] -> the key data of fold_in(key[r], step[r or 0]) (XLA's fold)."""
    typed = jax.random.wrap_key_data(keys, impl=key_impl)
    axis = None if step.shape[0] == 1 else 0
    folded = jax.vmap(jax.random.fold_in, in_axes=(0, axis))(
        typed, step[0] if axis is None else step
    )
    return jax.random.key_data(folded)


def _step_operand(step, b: int) -> jax.Array:
    """step (), [1] or [B] -> int32 [1] or [B] (the op's last operand)."""
    step = jnp.asarray(step)
    if not jnp.issubdtype(step.dtype, jnp.integer) or step.shape not in ((), (1,), (b,)):
        raise ValueError(
            f"step must be an int scalar or an int array of shape [B={b}], got "
            f"{step.dtype}{list(step.shape)}"
        )
    return jnp.reshape(step.astype(jnp.int32), (-1,))


def _kernel_folds(params) -> bool:
    """Whether the grid kernel folds the step in (threefry keys; else XLA folds first)."""
    return params.get("fold_step", False) and params["key_impl"] == "threefry2x32"


def _abstract(logits, thr, alt, t_a, t_b, top_p, keys, *_step, **_: Any):
    b = logits.shape[0]
    return (
        jax.core.ShapedArray((b,), jnp.int32),
        jax.core.ShapedArray((b,), jnp.float32),
        jax.core.ShapedArray((b,), jnp.float32),
    )


_sample_p.def_abstract_eval(_abstract)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_sample_p.bind, **params))


_sample_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _reference(
    logits, thr, alt, t_a, t_b, top_p, keys, *step, kind, top_k, key_impl, stats_method, **_
):
    from rejax import sampling  # sampling imports this module

    if step:
        keys = _fold_step(keys, step[0], key_impl)
    return sampling._reference_tempered(
        logits.astype(jnp.float32), thr, alt, t_a, t_b, top_p, jax.random.wrap_key_data(keys, impl=key_impl),
        kind=kind, top_k=top_k, stats_method=stats_method,
    )  # fmt: skip


def _lower_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_reference, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _supported(b: int, v: int, top_k: int, keys_shape, launch: str) -> tuple[bool, str]:
    if tuple(keys_shape) != (b, 2):
        return False, f"key data of shape {tuple(keys_shape)} (the kernel takes threefry [B, 2])"
    if launch != "ptx":
        return False, f"launch={launch!r} (the sampler kernels use the PTX custom call only)"
    return kernels.check_shape(b, v, top_k)


def _lower_cuda(ctx, *args, **params):
    b, v = ctx.avals_in[0].shape
    supported = _supported(b, v, params["top_k"], ctx.avals_in[6].shape, params["launch"])
    kern = None
    folds = _kernel_folds(params) and params["variant"] in kernels.GRID_VARIANTS
    if supported[0] and params["impl"] != "ref":
        try:
            kern = kernels.build(b, v, params["top_k"], variant=params["variant"],
                                 logits_dtype=str(ctx.avals_in[0].dtype),
                                 step_rows=ctx.avals_in[7].shape[0] if folds else 0)  # fmt: skip
        except kernels.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(OP, params["impl"], supported):
        fn = functools.partial(_reference, **params)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    if len(args) == 8 and not folds:  # the other kernels take folded keys
        return mlir.lower_fun(functools.partial(_fold_then, kern=kern, **params),
                              multiple_results=True)(ctx, *args)  # fmt: skip
    if kern.plan.variant in kernels.GRID_VARIANTS:
        impl = _cuda_impl_grid
    elif kern.plan.variant in kernels.CLUSTER_VARIANTS:
        impl = _cuda_impl_cluster
    else:  # "split" and "merge"
        impl = _cuda_impl
    return mlir.lower_fun(functools.partial(impl, kern=kern), multiple_results=True)(ctx, *args)


def _fold_then(*args, kern, key_impl, **_):
    # XLA folds the step into the keys, then the kernels run on the op's seven operands
    keys = _fold_step(args[6], args[7], key_impl)
    if kern.plan.variant in kernels.GRID_VARIANTS:
        impl = _cuda_impl_grid
    elif kern.plan.variant in kernels.CLUSTER_VARIANTS:
        impl = _cuda_impl_cluster
    else:
        impl = _cuda_impl
    return impl(*args[:6], keys, kern=kern)


def _call(kern, entry: str, out, *operands):
    return _dispatch.ptx_call(kern.backend_config(entry), out, *operands)


def _cuda_impl(logits, thr, alt, t_a, t_b, top_p, keys, *, kern):
    b = logits.shape[0]
    f32, i32 = jnp.float32, jnp.int32
    stats, arg = _call(
        kern,
        "rejax_sample_stats",
        (jax.ShapeDtypeStruct((b, 4), f32), jax.ShapeDtypeStruct((b, 2), i32)),
        logits, thr, alt, t_a, t_b,
    )  # fmt: skip
    plan = _call(
        kern,
        "rejax_sample_hist",
        jax.ShapeDtypeStruct((b, kernels.PLAN_WORDS), i32),
        logits, stats, arg, top_p, keys,
    )  # fmt: skip
    tokens = _call(
        kern,
        "rejax_sample_resolve",
        jax.ShapeDtypeStruct((b,), i32),
        logits, stats, arg, top_p, keys, plan,
    )  # fmt: skip
    return tokens, stats[:, 3], stats[:, 1]


def _one_launch(entry: str):
    # the cluster and grid kernels: one call, the op's seven operands (the grid kernel folding
    # the step in: eight) and three results
    def impl(logits, thr, alt, t_a, t_b, top_p, keys, *step, kern):
        avals = _abstract(logits, thr, alt, t_a, t_b, top_p, keys)
        outs = tuple(jax.ShapeDtypeStruct(a.shape, a.dtype) for a in avals)
        return _call(kern, entry, outs, logits, thr, alt, t_a, t_b, top_p, keys, *step)

    return impl


_cuda_impl_cluster = _one_launch("rejax_sample_cluster")
_cuda_impl_grid = _one_launch("rejax_sample_grid")


def _fold_rows(args, dims) -> tuple[int, list]:
    # vmap adds a leading dim n over rows: fold it into B (rows are independent)
    n = next(a.shape[d] for a, d in zip(args, dims, strict=True) if d is not None)
    flat = []
    for a, d in zip(args, dims, strict=True):
        a = jnp.broadcast_to(a, (n, *a.shape)) if d is None else jnp.moveaxis(a, d, 0)
        flat.append(a.reshape(n * a.shape[1], *a.shape[2:]))
    return n, flat


def _batch(args, dims, **params):
    if params.get("fold_step"):  # fold first (a batched step is per row), then batch the rest
        args, dims = _unfold_batched(args, dims, params)
        params = {**params, "fold_step": False}
    n, flat = _fold_rows(args, dims)
    outs = _sample_p.bind(*flat, **params)
    return [o.reshape(n, -1) for o in outs], [0, 0, 0]


def _unfold_batched(args, dims, params):
    # (args with the step folded into the keys, dims) under vmap: keys [.., B, 2], step [.., S]
    keys, kd, step, sd = args[6], dims[6], args[-1], dims[-1]
    keys = jnp.moveaxis(keys, kd, 0) if kd is not None else keys[None]
    step = jnp.moveaxis(step, sd, 0) if sd is not None else step[None]
    n = max(keys.shape[0], step.shape[0])
    keys = jnp.broadcast_to(keys, (n, *keys.shape[1:]))
    step = jnp.broadcast_to(step, (n, *step.shape[1:]))
    folded = jax.vmap(lambda k, s: _fold_step(k, s, params["key_impl"]))(keys, step)
    args = (*args[:6], folded, *args[7:-1])
    dims = (*dims[:6], 0, *dims[7:-1])
    return args, dims


batching.primitive_batchers[_sample_p] = _batch
mlir.register_lowering(_sample_p, _lower_reference)
mlir.register_lowering(_sample_p, _lower_cuda, platform="cuda")

# ReSET's step: the draw and the state update (operands: _sample_p's seven, then the state's
# ring, n_ring, ring_pos, s_sum, s_n, g_sum, g_n, y1, y2 and the nl / dnl masks; results:
# tokens, entropy, temperature and the new state's nine arrays).
_reset_p = Primitive("rejax_sample_reset")
_reset_p.multiple_results = True
_STATE_FIELDS = ("ring", "n_ring", "ring_pos", "s_sum", "s_n", "g_sum", "g_n", "y1", "y2")


def _abstract_reset(logits, *args, **_: Any):  # (the step, when given, is the last operand)
    b, w = logits.shape[0], args[6].shape[1]
    f32, i32 = jnp.float32, jnp.int32
    shapes = [((b,), i32), ((b,), f32), ((b,), f32), ((b, w), f32)]
    shapes += [((b,), d) for d in (i32, i32, f32, i32, f32, i32, i32, i32)]
    return tuple(jax.core.ShapedArray(shape, dtype) for shape, dtype in shapes)


_reset_p.def_abstract_eval(_abstract_reset)


@functools.cache
def _jitted_bind_reset(**params):
    return jax.jit(functools.partial(_reset_p.bind, **params))


_reset_p.def_impl(lambda *args, **params: _jitted_bind_reset(**params)(*args))


def _composed_reset(logits, thr, alt, t_a, t_b, top_p, keys, *rest, launch, key_impl,
                    stats_method, impl, variant="grid", fold_step=False):  # fmt: skip
    # the draw (the "grid" op, or its reference), then rejax.sampling's state update in XLA:
    # exactly the non-fused path
    from rejax import sampling  # sampling imports this module

    tokens, h, t = _sample_p.bind(
        logits, thr, alt, t_a, t_b, top_p, keys, *rest[11:], launch=launch, kind="reset",
        top_k=0, key_impl=key_impl, stats_method=stats_method, impl=impl, variant=variant,
        fold_step=fold_step,
    )  # fmt: skip
    state = sampling.SamplerState(*rest[:9])
    state = sampling._observe(sampling._push(h, state), tokens, rest[9], rest[10])
    return (tokens, h, t, *(getattr(state, f) for f in _STATE_FIELDS))


def _lower_reset(ctx, *args, **params):
    return mlir.lower_fun(functools.partial(_composed_reset, **params), multiple_results=True)(
        ctx, *args
    )


# The state's nine operands (7..15) share their buffers with the nine new-state results (3..11):
# the kernel updates the state in place, so a decode loop carries it without copies (each
# element is read before it is written, by the thread that writes it; `reset_record`).
STATE_ALIASES = {7 + i: 3 + i for i in range(9)}


def _lower_cuda_reset(ctx, *args, **params):
    b, v = ctx.avals_in[0].shape
    w = ctx.avals_in[7].shape[1]
    supported = _supported(b, v, 0, ctx.avals_in[6].shape, params["launch"])
    if params.get("fold_step") and not _kernel_folds(params):
        supported = (False, f"key_impl={params['key_impl']!r} (the kernel folds threefry keys)")
    kern = None
    if supported[0] and params["impl"] != "ref":
        try:
            kern = kernels.build(b, v, 0, variant=params.get("variant", "grid"), window=w,
                                 logits_dtype=str(ctx.avals_in[0].dtype),
                                 step_rows=ctx.avals_in[18].shape[0] if params.get("fold_step") else 0)  # fmt: skip
        except kernels.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(OP, params["impl"], supported):
        return _lower_reset(ctx, *args, **params)

    def fused(*xs):
        outs = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in _abstract_reset(*xs)]
        config = kern.backend_config("rejax_sample_grid")
        return _dispatch.ptx_call(config, tuple(outs), *xs, aliases=STATE_ALIASES)

    return mlir.lower_fun(fused, multiple_results=True)(ctx, *args)


def _batch_reset(args, dims, **params):
    # vmap over a leading dim n of the rows' arguments: fold it into B; the masks stay shared
    if params.get("fold_step"):  # fold first (a batched step is per row), then batch the rest
        args, dims = _unfold_batched(args, dims, params)
        params = {**params, "fold_step": False}
    if dims[-1] is not None or dims[-2] is not None:
        raise NotImplementedError("ReSET's newline masks cannot be batched: one vocabulary")
    n, flat = _fold_rows(args[:-2], dims[:-2])
    outs = _reset_p.bind(*flat, *args[-2:], **params)
    return [o.reshape(n, o.shape[0] // n, *o.shape[1:]) for o in outs], [0] * len(outs)


batching.primitive_batchers[_reset_p] = _batch_reset
mlir.register_lowering(_reset_p, _lower_reset)
mlir.register_lowering(_reset_p, _lower_cuda_reset, platform="cuda")


def _op_logits(logits: jax.Array) -> jax.Array:
    """The logits as the kernels read them: float32 or bfloat16 as they are (a bfloat16 logit
    is read as its exact float32 value, so both give the same draws), any other float cast to
    float32."""
    if not jnp.issubdtype(logits.dtype, jnp.floating):
        raise ValueError(f"logits must be float [B, V], got {logits.dtype}{logits.shape}")
    return logits if logits.dtype in (jnp.float32, jnp.bfloat16) else logits.astype(jnp.float32)


def sample_reset_step(
    logits: jax.Array,
    thr: jax.Array,
    alt: jax.Array,
    t_a: jax.Array,
    t_b: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    state: Any,
    nl_mask: jax.Array,
    dnl_mask: jax.Array,
    *,
    impl: str = "auto",
    stats_method: str = "two_pass",
    variant: str = "grid",
    step: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, Any]:
    """`sample_top_p(..., kind="reset", variant=variant)` and ReSET's state update after it
    (`rejax.sampling._push` the entropies, `_observe` the tokens) as one op: on CUDA one launch
    of the grid kernel built with the state (`STATE_VARIANT`), elsewhere (or where the kernel
    does not serve) the draw and then the update in XLA, the non-fused path exactly.

    Args:
      logits, thr, alt, t_a, t_b, top_p, keys, impl, stats_method: as `sample_top_p`.
      variant: the draw, "grid" or "cdf" (`kernels.GRID_VARIANTS`). Static.
      state: the rows' `rejax.sampling.SamplerState` (ring of w entropies).
      nl_mask, dnl_mask: bool [V], ReSET's newline masks.
      step: None (keys as given), or int () / [B]: row r draws with fold_in(keys[r], step[r])
        (the same bits; the kernel folds it in its launch).

    Returns:
      (tokens i32 [B], entropy f32 [B], temperature f32 [B], the new state).
    """
    from rejax import sampling  # sampling imports this module

    _dispatch.check_impl(impl)
    if variant not in kernels.GRID_VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {kernels.GRID_VARIANTS}")
    logits = _op_logits(logits)
    v = logits.shape[-1]
    for name, mask in (("nl_mask", nl_mask), ("dnl_mask", dnl_mask)):
        if mask.shape != (v,) or mask.dtype != jnp.bool_:
            raise ValueError(f"{name} must be bool [{v}], got {mask.dtype}{mask.shape}")
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    params = {"key_impl": str(jax.random.key_impl(keys)), "stats_method": stats_method}
    params |= {"impl": impl, "launch": launch, "variant": variant, "fold_step": step is not None}
    extra = () if step is None else (_step_operand(step, logits.shape[0]),)
    outs = _reset_p.bind(
        logits, thr, alt, t_a, t_b, top_p, jax.random.key_data(keys),
        *(getattr(state, f) for f in _STATE_FIELDS), nl_mask, dnl_mask, *extra, **params,
    )  # fmt: skip
    return outs[0], outs[1], outs[2], sampling.SamplerState(*outs[3:])


def sample_top_p(
    logits: jax.Array,
    thr: jax.Array,
    alt: jax.Array,
    t_a: jax.Array,
    t_b: jax.Array,
    top_p: jax.Array,
    keys: jax.Array,
    *,
    kind: str,
    top_k: int = 0,
    impl: str = "auto",
    stats_method: str = "two_pass",
    variant: str = VARIANT,
    step: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One token per row (module docstring).

    Args:
      logits: [B, V] raw logits, f32 or bf16 (read as their f32 values: the same draws; the
        kernels read half the bytes); another float dtype is cast to f32.
      thr, alt: f32 [B]: a row takes t_a iff its entropy h >= thr or h > alt, else t_b.
      t_a, t_b: f32 [B] temperatures (<= 1e-6: greedy, the first argmax of the raw logits).
      top_p: f32 [B] in (0, 1].
      keys: [B] typed jax.random keys, one per row (fold the step in before, or pass `step`).
      kind: "temperature" or "reset" (only how the reference sums its denominators). Static.
      top_k: > 0 keeps the tokens whose tempered logit is >= the k-th largest before top-p
        (`rejax.sampling.Temperature`'s rule). Static.
      impl: "auto" (kernel on CUDA when supported), "ref", or "cuda" (kernel or an error).
      stats_method: the reference's statistics ("two_pass" / "online"). Static.
      variant: which CUDA kernels: one of `VARIANTS` (the same algorithm and noise), or "auto"
        (`choose_variant`: by the rows and top_k). Static.
      step: None (keys as given), or int () / [B]: row r draws with fold_in(keys[r], step[r])
        (the same bits; "grid" and "cdf" fold it in their launch, other paths in XLA first).

    Returns:
      (tokens i32 [B], entropy f32 [B], temperature f32 [B]).
    """
    _dispatch.check_impl(impl)
    if kind not in KINDS:
        raise ValueError(f"kind={kind!r}, expected one of {KINDS}")
    if variant not in VARIANT_CHOICES:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANT_CHOICES}")
    logits = _op_logits(logits)
    key_impl = str(jax.random.key_impl(keys))
    data = jax.random.key_data(keys)
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    if not isinstance(top_k, (int, np.integer)) or not 0 <= top_k <= logits.shape[-1]:
        raise ValueError(f"top_k={top_k!r}, expected an int in [0, V={logits.shape[-1]}]")
    variant = choose_variant(variant, logits.shape[0], int(top_k))
    params = {"kind": kind, "top_k": int(top_k), "key_impl": key_impl}
    params |= {"stats_method": stats_method, "impl": impl, "variant": variant}
    params |= {"fold_step": step is not None}
    extra = () if step is None else (_step_operand(step, logits.shape[0]),)
    outs = _sample_p.bind(logits, thr, alt, t_a, t_b, top_p, data, *extra, launch=launch, **params)
    return tuple(outs)


def sample_kernel(
    key: jax.Array,
    logits: jax.Array,
    state: Any,
    sampler: Any,
    *,
    variant: str = VARIANT,
    impl: str = "auto",
    stats_method: str = "two_pass",
) -> tuple[jax.Array, Any, dict]:
    """`rejax.sampling.sample(..., top_p_method="kernel")` with the kernel variant explicit.

    The same checks, per-row keys, op call and ReSET state update as `sample`'s kernel path
    (`rejax.sampling._sample_kernel`), for Temperature and ReSET in reference semantics.

    Args:
      key, logits, state, sampler, stats_method: as `rejax.sampling.sample`.
      variant: one of `VARIANTS` or "auto", as `sample_top_p`, or one of `STATE_VARIANTS`
        ("grid-state" / "cdf-state": that draw with ReSET's state update in the kernel,
        `sample_reset_step`; "auto" runs "grid-state" for ReSET wherever it picks "grid").
        Static.
      impl: as `sample_top_p`.

    Returns:
      (tokens i32 [B], state, info) as `rejax.sampling.sample`.
    """
    if variant not in (*VARIANT_CHOICES, *STATE_VARIANTS):
        raise ValueError(
            f"variant={variant!r}, expected one of {(*VARIANT_CHOICES, *STATE_VARIANTS)}"
        )
    from rejax import sampling  # sampling imports this module

    sampling._check_sampler(sampler)
    if not sampling._kernel_serves(sampler):
        raise ValueError(f"{type(sampler).__name__} is not served by the fused kernel: {sampler}")
    logits = sampling._check_logits(logits)
    b, v = logits.shape
    window = sampler.window if isinstance(sampler, sampling.ReSET) else None
    sampling._check_state(state, b, window)
    if isinstance(sampler, sampling.ReSET):
        sampling._check_masks(sampler, v)
    elif sampler.top_k > v:
        raise ValueError(f"Temperature.top_k={sampler.top_k} exceeds the vocabulary V={v}")
    keys = sampling._row_keys(key, b)
    return sampling._sample_kernel(keys, logits, state, sampler, stats_method, variant, impl)


# ----------------------------------------------------------------------------- emulation

_KEY_LO = (127 - 31) << 23
_BIN_BITS = 17
_FLOOR = np.float32(-43.0)  # no token below this tempered logit can win (sampler.cu's FLOOR)
_PRUNE_SCORE = np.float32(-3.67)  # below the top-ranked token's least score (sampler.cu)
PATHS = (
    "greedy", "full", "whole", "collect", "large", "topk_list", "topk_select", "topk_large",
    "topk_merge",
)  # fmt: skip
MERGE_CAND = 64  # sampler.cu's CAND: the most top-k candidates a chunk lists ("merge")


def philox(c0, k0, k1, c1=0, c2=0, c3=0) -> tuple[np.ndarray, ...]:
    """Philox-4x32-10 (Random123's constants): the 4 output words, elementwise over uint32."""
    c = [np.asarray(x, np.uint64) & np.uint64(0xFFFFFFFF) for x in (c0, c1, c2, c3)]
    k0, k1 = np.asarray(k0, np.uint64), np.asarray(k1, np.uint64)
    mask = np.uint64(0xFFFFFFFF)
    for r in range(10):
        if r:
            k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
        p0, p1 = np.uint64(0xD2511F53) * c[0], np.uint64(0xCD9E8D57) * c[2]
        c = [(p1 >> np.uint64(32)) ^ c[1] ^ k0, p1 & mask, (p0 >> np.uint64(32)) ^ c[3] ^ k1,
             p0 & mask]  # fmt: skip
    return tuple(x.astype(np.uint32) for x in c)


def threefry_fold_in(k0, k1, data) -> tuple[np.ndarray, np.ndarray]:
    """sampler.cu's `threefry_fold_in`, elementwise over uint32: the key data of
    jax.random.fold_in((k0, k1), data) for threefry keys (Threefry-2x32, 20 rounds, on the
    counter pair (0, data))."""
    mask = np.uint64(0xFFFFFFFF)
    k0, k1 = np.asarray(k0, np.uint64) & mask, np.asarray(k1, np.uint64) & mask
    ks = (k0, k1, k0 ^ k1 ^ np.uint64(0x1BD11BDA))
    x0 = ks[0] + np.uint64(0)
    x1 = (np.asarray(data).astype(np.int64).astype(np.uint64) + ks[1]) & mask
    rot = ((13, 15, 26, 6), (17, 29, 16, 24))
    for i in range(5):
        for r in rot[i & 1]:
            x0 = (x0 + x1) & mask
            x1 = ((x1 << np.uint64(r)) | (x1 >> np.uint64(32 - r))) & mask
            x1 = x1 ^ x0
        x0 = (x0 + ks[(i + 1) % 3]) & mask
        x1 = (x1 + ks[(i + 2) % 3] + np.uint64(i + 1)) & mask
    return x0.astype(np.uint32), x1.astype(np.uint32)


def gumbel_of_bits(hi, lo) -> np.ndarray:
    """sampler.cu's `gumbel_of`: f32 Gumbel noise of 55 random bits, uint32 `hi` and the top 23
    bits of uint32 `lo`. u = (hi * 2**23 + (lo >> 9) + 1/2) / 2**55, x = min(u, 1 - u) from the
    bits (the complement is bitwise), E = -log(1 - u) as -log1p(-x) for u < 1/2 and -log(x)
    otherwise, noise -log(E): it spans [-3.66, 38.82] with the far tail right to float rounding.
    """
    hi, lo = np.asarray(hi, np.uint32), np.asarray(lo, np.uint32)
    upper = hi >= np.uint32(1 << 31)
    a = np.where(upper, ~hi, hi)
    b = np.where(upper, ~lo, lo) >> np.uint32(9)
    x = a.astype(np.float32) * np.float32(2.0**-32) + (
        b.astype(np.float32) + np.float32(0.5)
    ) * np.float32(2.0**-55)
    with np.errstate(divide="ignore"):  # log(0) in the branch not taken
        e = np.where(upper, -np.log(x), -np.log1p(-x))
    return -np.log(e)


def gumbel_bound(hi) -> np.ndarray:
    """sampler.cu's `gumbel_bound`: f32 upper bound of `gumbel_of_bits(hi, lo)` over every lo.

    u >= 1/2 (hi >= 2**31) gives E >= log 2, so noise <= -log(log 2); below, E = -log1p(-x) >= x
    >= hi 2**-32, so noise <= 32 log 2 - log(hi), plus 1e-4 for the kernel's fast logarithm.
    """
    hi = np.asarray(hi, np.uint32)
    with np.errstate(divide="ignore"):
        low = np.float32(22.18071) + np.float32(1e-4) - np.log(hi.astype(np.float32))
    return np.where(hi >= np.uint32(1 << 31), np.float32(0.36652),
                    np.where(hi == 0, np.float32(np.inf), low)).astype(np.float32)  # fmt: skip


def _hi_words(k0, k1, ids) -> np.ndarray:
    # word id % 4 of Philox at counter (id / 4, 0, 0, 0): the noise's high word
    ids = np.asarray(ids, np.uint32)
    ctr, r = ids >> np.uint32(2), (ids & np.uint32(3)).astype(np.intp)
    return np.choose(r, philox(ctr, k0, k1))


def gumbel(k0, k1, ids) -> np.ndarray:
    """The kernels' Gumbel noise of token ids under key (k0, k1) (broadcasting): `gumbel_of_bits`
    of word id % 4 of Philox at counters (id / 4, 0, 0, 0) and (id / 4, 1, 0, 0)."""
    ids = np.asarray(ids, np.uint32)
    ctr, r = ids >> np.uint32(2), (ids & np.uint32(3)).astype(np.intp)
    hi = _hi_words(k0, k1, ids)
    # the low word only where it can matter (min(hi, ~hi) < 2**24), as sampler.cu does
    need = np.minimum(hi, ~hi) < np.uint32(1 << 24)
    sub = [np.broadcast_to(np.asarray(x, np.uint32), hi.shape)[need] for x in (ctr, k0, k1)]
    lo = np.zeros_like(hi)
    lo[need] = np.choose(np.broadcast_to(r, hi.shape)[need], philox(*sub, 1))
    return gumbel_of_bits(hi, lo)


def _masses(keys: np.ndarray) -> np.ndarray:
    p = keys.astype(np.uint32).view(np.float32)
    return np.rint(p * np.float32(2.0**30)).astype(np.int64)


def _bins(keys: np.ndarray) -> np.ndarray:
    k = keys.astype(np.int64)
    return np.where(k > _KEY_LO, ((k - _KEY_LO - 1) >> _BIN_BITS) + 1, 0)


def _boundary(mass: np.ndarray, cnt: np.ndarray, base: int, limit: np.float32) -> tuple[int, int]:
    # the lowest non-empty bin whose top-ranked token is kept: (float)(mass above) < limit
    above = base + np.concatenate([np.cumsum(mass[::-1])[::-1][1:], [0]])
    ok = (cnt > 0) & (above.astype(np.float32) < limit)
    b = int(np.flatnonzero(ok)[0])
    return b, int(above[b])


def _row_stats(z: np.ndarray, chunks: int, ia: np.float32, ib: np.float32):
    # per-chunk max / sums, combined at the row max (the stats kernel)
    parts = []
    for zc in np.array_split(z, min(chunks, z.shape[0])):
        mc = zc.max()
        if mc == -np.inf:
            parts.append((mc, 0.0, 0.0, 0.0, 0.0))
            continue
        d = zc - mc
        e = np.exp(d)
        with np.errstate(invalid="ignore"):  # e * d = 0 * -inf at masked logits (not summed)
            u = np.sum(np.where(e > 0, e * d, 0), dtype=np.float32)
        parts.append((mc, e.sum(dtype=np.float32), u, np.exp(d * ia).sum(dtype=np.float32),
                      np.exp(d * ib).sum(dtype=np.float32)))  # fmt: skip
    p = np.array(parts, np.float32)
    m = p[:, 0].max()
    live = p[:, 1] > 0
    dm = np.where(live, p[:, 0] - m, 0).astype(np.float32)
    w = np.where(live, np.exp(dm), 0).astype(np.float32)
    s = np.sum(p[:, 1] * w, dtype=np.float32)
    u = np.sum(w * (p[:, 2] + p[:, 1] * dm), dtype=np.float32)
    sa = np.sum(np.where(live, p[:, 3] * np.exp(dm * ia), 0), dtype=np.float32)
    sb = np.sum(np.where(live, p[:, 4] * np.exp(dm * ib), 0), dtype=np.float32)
    h = np.float32(np.log(s) - u / s)
    return m, h, sa, sb


def _probs(zt, live, den):
    with np.errstate(under="ignore", over="ignore"):
        probs = np.where(live, np.exp(zt) * (np.float32(1) / den), 0).astype(np.float32)
    keys = probs.view(np.uint32).astype(np.int64)
    return probs, keys, np.where(live, _masses(keys), 0)


def zt_cut(den) -> np.float32:
    """The cluster kernel's zt_cut: tokens below it have p <= 2**-31 (no mass; its expf skipped)."""
    return np.float32(np.log(np.float32(den))) - np.float32(21.487563) - np.float32(0.01)


def bin_window(b: int, den) -> tuple[np.float32, np.float32]:
    """The cluster kernel's zt window around top-p bin b: its tokens' tempered logits lie in it."""
    lo = _KEY_LO + 1 + ((b - 1) << _BIN_BITS)
    p = np.array([lo, lo + (1 << _BIN_BITS)], np.uint32).view(np.float32)
    with np.errstate(divide="ignore"):
        zw = np.log(p * np.float32(den)).astype(np.float32)
    return zw[0] - np.float32(1e-3), zw[1] + np.float32(1e-3)


def _top_p_keep(zt, live, den, tp, nmax, collect, cluster=False):
    # the histogram kernel's boundary bin, then resolve's collect (or large-bin) path; the cluster
    # kernel bins only tokens at or above zt_cut and collects within bin_window
    probs, keys, q = _probs(zt, live, den)
    if tp >= 1:
        return live, probs, "full"
    nb = kernels.NB
    bins = np.where(live, _bins(keys), -1)
    if cluster:
        bins = np.where(live & (zt < zt_cut(den)), 0, bins)
    mass = np.bincount(bins[bins > 0], weights=q[bins > 0], minlength=nb).astype(np.int64)
    cnt = np.bincount(bins[bins > 0], minlength=nb)
    limit = tp * np.float32(mass.sum())  # the histogram's total (bin 0 has no mass)
    b, above_b = _boundary(mass, cnt, 0, limit)
    lo = _KEY_LO + 1 + ((b - 1) << _BIN_BITS)
    keep = live & (bins > b)
    edge = int(_masses(np.array([lo]))[0])
    if cnt[b] == 1 or np.float32(above_b + mass[b] - edge) < limit:
        return keep | (bins == b), probs, "whole"
    if cluster and cnt[b] <= nmax:  # the cluster kernel collects within the zt window
        zlo, zhi = bin_window(b, den)
        collect = np.sum((bins == b) & (zt >= zlo) & (zt <= zhi)) == cnt[b]
    if collect and cnt[b] <= nmax:  # collect, sort by (p, id) descending, exact prefix
        sel = np.flatnonzero(bins == b)
        order = sel[np.lexsort((-sel, -keys[sel]))]
        excl = above_b + np.cumsum(q[order]) - q[order]
        keep[order[excl.astype(np.float32) < limit]] = True
        return keep, probs, "collect"
    # two finer levels, then the tie group cut by id
    inb = bins == b
    sub = np.where(inb, (keys - lo) >> 6, -1)
    m2 = np.bincount(sub[inb], weights=q[inb], minlength=nb).astype(np.int64)
    b2, above = _boundary(m2, np.bincount(sub[inb], minlength=nb), above_b, limit)
    lo2 = lo + (b2 << 6)
    ins = inb & (sub == b2)
    m3 = np.bincount(keys[ins] - lo2, weights=q[ins], minlength=64).astype(np.int64)
    b3, above = _boundary(m3, np.bincount(keys[ins] - lo2, minlength=64), above, limit)
    kb = lo2 + b3
    tie = live & (keys == kb)
    qb = int(_masses(np.array([kb]))[0])
    j = np.arange(int(tie.sum()))
    n_keep = int(np.sum((above + j * qb).astype(np.float32) < limit))
    rank = tie.sum() - np.cumsum(tie)  # ties at higher ids
    keep |= inb & ((keys > kb) | (tie & (rank < n_keep)))
    return keep, probs, "large"


def _top_k_boundary(cnt, k):
    # sampler.cu's topk_boundary: the highest bin whose count from the top reaches k and the
    # count at or above it (bin 0 and the whole count when fewer than k are counted)
    suffix = np.cumsum(cnt[::-1])[::-1]
    hits = np.flatnonzero(suffix >= k)
    return (int(hits[-1]), int(suffix[hits[-1]])) if hits.size else (0, int(cnt.sum()))


def _merged_candidates(tbin, live, k, chunks, b):
    # the "merge" variant (TOPK_MERGE): each chunk lists its live tokens in bins at or above its
    # own k-th largest's (None when a chunk has more than MERGE_CAND: the row takes the split
    # path); the draw's list is those in bins >= the row's b
    v = len(live)
    chunk = kernels._cdiv(kernels._cdiv(v, chunks), 4) * 4  # kernels.plan's chunk length
    lists = []
    for lo in range(0, v, chunk):
        cb, cl = tbin[lo : lo + chunk], live[lo : lo + chunk]
        b_loc, n_loc = _top_k_boundary(np.bincount(cb[cl], minlength=kernels.NB), k)
        if n_loc > MERGE_CAND:
            return None
        lists.append(lo + np.flatnonzero(cl & (cb >= b_loc)))
    cand = np.concatenate(lists)
    return cand[tbin[cand] >= b]


def _top_k_keep(zt, live, t, k, tp, nmax, merge_chunks=0):
    # top-k bins of the tempered logit, the bin of the k-th largest, then the list (or the last
    # block's selection over V, or its top-p over the top-k set for a huge tie group); with
    # merge_chunks (the "merge" variant, k <= MERGE_MAX_K) the list is the chunks' candidates
    nb = kernels.NB
    x = -zt * (np.float32(t) * np.float32(64.0))
    with np.errstate(invalid="ignore"):
        tbin = nb - 1 - np.where(x < nb - 1, np.floor(np.where(live, x, 0)), nb - 1).astype(int)
    b, c = _top_k_boundary(np.bincount(tbin[live], minlength=nb), k)
    n_live = int(live.sum())
    vk = np.sort(zt[live])[::-1][k - 1] if n_live >= k else -np.inf
    in_k = live & (zt >= vk)
    merged = None
    if merge_chunks and k <= kernels.MERGE_MAX_K and c <= nmax:
        merged = _merged_candidates(tbin, live, k, merge_chunks, b)
    if merged is not None:  # the top-k set as the kernel finds it in the merged list
        vals = np.sort(zt[merged])[::-1]
        vk = vals[k - 1] if len(vals) >= k else -np.inf
        in_k = np.zeros_like(live)
        in_k[merged[zt[merged] >= vk]] = True
    den = np.sum(np.exp(zt[in_k]), dtype=np.float32)
    if merged is not None:
        path = "topk_merge"
    elif c <= nmax:
        path = "topk_list"
    elif n_live >= k and int(in_k.sum()) <= nmax:
        path = "topk_select"
    else:
        keep, probs, _ = _top_p_keep(zt, in_k, den, tp, nmax, collect=False)
        return keep, probs, "topk_large"
    probs, keys, q = _probs(zt, in_k, den)
    if tp >= 1:
        return in_k, probs, path
    sel = np.flatnonzero(in_k)
    order = sel[np.lexsort((-sel, -keys[sel]))]
    limit = tp * np.float32(q.sum())
    excl = np.cumsum(q[order]) - q[order]
    keep = np.zeros_like(live)
    keep[order[excl.astype(np.float32) < limit]] = True
    return keep, probs, path


def emulate(
    logits,
    thr,
    alt,
    t_a,
    t_b,
    top_p,
    key_data,
    *,
    top_k: int = 0,
    chunks: int = 8,
    nmax: int = kernels.NMAX,
    prune: bool | str = True,
    variant: str = "split",
) -> dict:
    """The kernels' algorithm in NumPy for one row of logits and many keys.

    Args:
      logits: f32 [V] one row; thr, alt, t_a, t_b, top_p: its scalars.
      key_data: uint32 [n, 2] row keys (n independent draws from the same logits).
      top_k: > 0: top-k (on the tempered logits, ties kept) before top-p.
      chunks: blocks per row of the statistics pass (the cluster kernel: 8), and of the top-k
        candidate lists of the "merge" variant; nmax: the collected bin's capacity.
      prune: skip tokens that cannot beat the top-ranked token's score as the kernels do: True
        or "floor" (tempered logit below FLOOR: the split kernels), "bound" (also a score bound
        of gumbel_bound below PRUNE_SCORE: the cluster kernel), False (none).
      variant: "cluster" also mirrors that kernel's zt_cut and collect window; "merge" its
        top-k list from per-chunk candidates (path "topk_merge"); "reject" is "cluster" plus
        its first draw over every token and that draw's keep test (`VARIANTS`); "grid" draws
        from "cluster"'s kept set (its kernel climbs the rank order from the first draw to the
        best kept score: the same token) and with top-k is "split" (a listed superset of the
        top-k set, cut at the k-th largest as "split"'s last block does). "cdf" keeps
        "grid"'s kept set and draws as its kernel does: `cdf_draws`' inverse-CDF draws, the
        first kept one, else (all rejected) the Gumbel-max over the kept tokens (the climb's).

    Returns:
      dict with "tokens" i32 [n], "entropy", "temperature", "probs" f32 [V] (the kernels'
      probabilities), "keep" bool [V] (the kept set) and "path" (one of `PATHS`); for
      "reject" with top-p < 1 and no top-k also "first" i32 [n] (the draw over every token)
      and "accepted" bool [n] (the kernel's keep test of it, from the integer masses alone:
      where True the kernel returns "first" and skips the histogram path).
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r}, expected one of {VARIANTS}")
    cdf = variant == "cdf" and not top_k
    if (
        variant in kernels.GRID_VARIANTS
    ):  # its top-k lists a superset of the top-k set as "split" does (the
        variant = "split" if top_k else "cluster"  # same kept set); its top-p keeps "cluster"'s
    z = np.asarray(logits, np.float32)
    key_data = np.asarray(key_data, np.uint32).reshape(-1, 2)
    k0, k1 = key_data[:, :1], key_data[:, 1:]
    raw = np.float32(t_a), np.float32(t_b)
    ta, tb = (np.float32(1.0) if x <= GREEDY_EPS else x for x in raw)
    m, h, sa, sb = _row_stats(z, chunks, np.float32(1) / ta, np.float32(1) / tb)
    high = bool(h >= np.float32(thr)) or bool(h > np.float32(alt))
    t, den = (raw[0], sa) if high else (raw[1], sb)
    out = {"entropy": h, "temperature": t}
    if t <= GREEDY_EPS:
        out.update(tokens=np.full(len(key_data), int(np.argmax(z)), np.int32), path="greedy",
                   probs=None, keep=None)  # fmt: skip
        return out
    zt = (z - m) * (np.float32(1) / t)
    live = zt > -np.inf
    tp = np.float32(top_p)
    if top_k:
        merge = chunks if variant == "merge" else 0
        keep, probs, path = _top_k_keep(zt, live, t, top_k, tp, nmax, merge)
    else:
        cluster = variant in kernels.CLUSTER_VARIANTS
        keep, probs, path = _top_p_keep(zt, live, den, tp, nmax, collect=True, cluster=cluster)
    out.update(probs=probs, keep=keep, path=path)
    out["tokens"] = _gumbel_max(zt, np.flatnonzero(keep), k0, k1, prune)
    if variant == "reject" and not top_k and tp < 1:
        first = _gumbel_max(zt, np.flatnonzero(live), k0, k1, prune)
        accepted = _reject_test(zt, live, den, tp, first)
        out.update(first=first, accepted=accepted)
        out["tokens"] = np.where(accepted, first, out["tokens"]).astype(np.int32)
    if cdf:
        it = np.float32(1) / (ta if high else tb)
        draws = cdf_draws(z, m, it, key_data)  # [n, NC], -1: no weight at all
        if tp >= 1:
            out["tokens"] = np.where(draws[:, 0] >= 0, draws[:, 0], out["tokens"]).astype(np.int32)
        else:
            tokens = out["tokens"].copy()
            for k in range(CDF_DRAWS - 1, -1, -1):  # the first kept draw
                d = draws[:, k]
                ok = (d >= 0) & _reject_test(zt, live, den, tp, np.maximum(d, 0))
                tokens = np.where(ok, d, tokens)
            out["tokens"] = tokens.astype(np.int32)
        out["draws"] = draws
    return out


CDF_DRAWS = 4  # sampler.cu NC: the "cdf" variant's first draws, kept-tested in one sweep
CDF_UNITS = 2.0**40  # sampler.cu cdf_units: a weight in [0, 1] in fixed point (truncated)


def cdf_draws(z, m, inv_t, key_data) -> np.ndarray:
    """The "cdf" kernel's CDF_DRAWS first draws per key: int32 [n, CDF_DRAWS] token ids (-1 if
    the row has no weight).

    A token's weight is exp((z - m) / t) in 2**-40 units (truncated), m the row's max; draw k
    is the token whose interval of the weights' integer prefix sums (vocabulary order) holds
    u = floor(r total / 2**64), r the 64 bits of Philox words 2k, 2k + 1 at counters (0, 2) and
    (1, 2) under the key. No launch plan enters: the token depends on the logits, the
    temperature and the key alone. numpy's float32 exp stands for CUDA's expf (they may differ
    in the last bit, which moves a draw only at a boundary)."""
    z = np.asarray(z, np.float32)
    key_data = np.asarray(key_data, np.uint32).reshape(-1, 2)
    n = key_data.shape[0]
    out = np.full((n, CDF_DRAWS), -1, np.int32)
    if not np.float32(m) > -np.inf:
        return out
    with np.errstate(invalid="ignore", over="ignore", under="ignore"):
        e = np.exp((z - np.float32(m)).astype(np.float32) * np.float32(inv_t)).astype(np.float32)
    w = np.nan_to_num(np.floor(e.astype(np.float64) * CDF_UNITS)).astype(np.uint64)
    cum = np.cumsum(w, dtype=np.uint64)
    total = int(cum[-1]) if len(cum) else 0
    if total == 0:
        return out
    k0, k1 = key_data[:, 0], key_data[:, 1]
    words = [*philox(0, k0, k1, 2), *philox(1, k0, k1, 2)]
    for k in range(CDF_DRAWS):
        r = [(int(a) << 32) | int(b) for a, b in zip(words[2 * k], words[2 * k + 1])]
        u = np.array([(x * total) >> 64 for x in r], np.uint64)
        out[:, k] = np.searchsorted(cum, u, side="right")
    return out


def _gumbel_max(zt, cand, k0, k1, prune) -> np.ndarray:
    # Gumbel-max over tokens `cand` per key, ties to the lower id; pruned below FLOOR (and the
    # bound) as the kernels prune
    if prune:
        cand = cand[zt[cand] >= _FLOOR]
    score = zt[cand][None, :] + gumbel(k0, k1, cand[None, :])
    if prune == "bound":
        reach = zt[cand][None, :] + gumbel_bound(_hi_words(k0, k1, cand[None, :])) >= _PRUNE_SCORE
        score = np.where(reach, score, -np.inf)
    return cand[np.argmax(score, axis=1)].astype(np.int32)


def _reject_test(zt, live, den, tp, first) -> np.ndarray:
    # the "reject" kernel's test of its first draw x, from integer masses only (no kept set):
    # the mass ranked above x (larger key, or the same key and a higher id) < tp * total, and
    # x has mass; the cluster kernel's zt_cut filter as in its sums
    _, keys, q = _probs(zt, live, den)
    q = np.where(live & (zt >= zt_cut(den)), q, 0)
    total = np.float32(q.sum())
    ids = np.arange(zt.shape[0])
    kx = keys[first]
    above = np.array(
        [q[(keys > k) | ((keys == k) & (ids > x))].sum() for k, x in zip(kx, first)], np.int64
    )
    return (keys[first] > _KEY_LO) & (above.astype(np.float32) < np.float32(tp) * total)
