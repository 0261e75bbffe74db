"""The NVFP4 linear: one primitive, a pure-JAX reference lowering and a CUDA kernel lowering.

GEMM letters in this file (as in cuda_ops): M rows of x (decode tokens), N out features, K in
features. The weight may be one matrix or a stack of them (a decoder's layers, [L, N, K/2] codes):
the primitive then receives the whole stack and a layer index (a device int32), and the kernel
offsets its pointers by the layer, so no layer's bytes are copied out of the stack.

* Every platform lowers the primitive to the reference (`rejax.nvfp4` numerics), so CPU tracing
  never touches NVRTC or the custom call. CPU uses the block-ordered summation for decode shapes
  (the kernel's order).
* The `platform="cuda"` lowering asks the one dispatch rule (`rejax.ops._dispatch.use_kernel`)
  about one kernel, chosen by M (after folding leading dims): below `GemmOptions.min_m` (8) the
  small-M GEMV of `cuda_ops/nvfp4_gemv.cu` (K % 256 == 0, activations fit in shared memory), from
  it on the W4A4 tensor-core GEMM of `cuda_ops/nvfp4_gemm.cu` (K % 128 == 0; its fp16 operand
  x_hat = e2m1 * SFx, in the kernel's K order, is an XLA fusion before it, `gemm_x_operand`;
  a K split adds a small second kernel that sums the float32 partials in split order; with
  `GemmOptions.x_quant` "kernel" the fused linears of rejax/ops/fused_linear.py hand it an
  x_hat that their quantizer kernel wrote instead, through `gemm_call_xhat`: the same
  launches, no XLA fusion). Either is emitted as XLA's PTX custom-kernel call (launch "ptx")
  or a command-buffer-compatible `buffer_callback` (launch "callback"). `gemv_call(residual=r)`
  (W4A4) returns r + y: either kernel adds r in its epilogue (-DEPI_RES=1, res [M, N] an
  operand after xg; with the GEMM's K split, the finish kernel's), the bf16 add of the
  reference. W4A4 linears of `GemmOptions.wgmma_min_m` .. `wgmma_max_m` rows (by default 128 ..
  2048) first take the warpgroup-MMA GEMM of `cuda_ops/nvfp4_gemm_wgmma.cu` (sm_90; its x_hat
  in its own K order and pre-tiled, `wgmma_x_operand` and `to_stage_tiles`; the residual as
  XLA's add), before the GEMM and the dot; where it does not build, the rest of this dispatch
  runs (a warning says why once where the options chose a range other than the default). When
  the chosen kernel does not apply (W4A16 above M = 8, an unsupported shape, a failed build),
  the reference
  runs with one bf16 tensor-core dot over the exactly pre-scaled values (never a sequential scan
  on a GPU), the reason logged once. Above `GemmOptions.max_m` rows (prefill) W4A4 takes that
  dot by choice; with `GemmOptions.dot_dequant` "kernel" (the default) the weight's bf16 values come
  from the dequantizer kernel of `cuda_ops/nvfp4_dequant.cu` (`dot_with_kernel`: the same
  values, so the same bits) instead of XLA's decode.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import nvfp4_dequant, nvfp4_gemm, nvfp4_gemm_wgmma, nvfp4_gemv
from rejax import nvfp4
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch

ACTS = ("w4a4", "w4a16")
MAX_M = nvfp4_gemv.MAX_M
OP = "nvfp4_linear"

_FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


# ----------------------------------------------------------------------------- reference


def _as_e4m3(s: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)


def _weight(wp, ws, wg, layer, n: int, k: int) -> Nvfp4Tensor:
    """The layer's Nvfp4Tensor from (possibly stacked) kernel operands."""
    w = Nvfp4Tensor(packed=wp, scales=_as_e4m3(ws), global_scale=wg, shape=(n, k))
    return nvfp4.take(w, layer) if wp.ndim == 3 else w


def _reference(
    *args,
    act: str,
    n: int,
    k: int,
    order: str = "auto",
    residual: bool = False,
    prefetch: nvfp4_gemv.Prefetch | None = None,
    **_: Any,
) -> jax.Array:
    """Reference numerics on the primitive's operands (see `_operands`; with `residual`, res
    [M, N] after xg and the bf16 add res + y; `prefetch` operands, last, are only hints)."""
    if prefetch is not None and prefetch.operands:
        args = args[: -prefetch.operands]
    if residual:
        xp, xs, xg, res, *w = args
        return res + _reference(xp, xs, xg, *w, act=act, n=n, k=k, order=order)
    if act == "w4a4":
        xp, xs, xg, wp, ws, wg, layer = args
        m = xp.shape[0]
        xq = Nvfp4Tensor(packed=xp, scales=_as_e4m3(xs), global_scale=xg, shape=(m, k))
        return nvfp4.nvfp4_matmul_q(xq, _weight(wp, ws, wg, layer, n, k), order=order)
    x, wp, ws, wg, layer = args
    return nvfp4.nvfp4_matmul(x, _weight(wp, ws, wg, layer, n, k), act="w4a16", order=order)


# ----------------------------------------------------------------------------- primitive

_gemv_p = Primitive("rejax_nvfp4_gemv")


def _abstract(*args, act: str, n: int, k: int, **_: Any):
    m = args[0].shape[0]
    return jax.core.ShapedArray((m, n), jnp.bfloat16)


_gemv_p.def_abstract_eval(_abstract)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_gemv_p.bind, **params))


# eager calls run the primitive through jit (and so through the lowering rules below)
_gemv_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _lower_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=False)(
        ctx, *args
    )


def _lower_gpu_reference(ctx, *args, **params):
    # one bf16 tensor-core dot over exactly pre-scaled values: the GPU-friendly reference
    fn = functools.partial(_reference, **{**params, "order": "dot"})
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _lower_cuda(ctx, *args, **params):
    m = ctx.avals_in[0].shape[0]
    act, n, k = params["act"], params["n"], params["k"]
    if takes_wgmma(act, m, params["impl"], params["gemm_options"]):
        kernel = wgmma_kernel(m, n, k, params["gemm_options"], params["gw_rows"])
        if kernel is not None:
            pf = params["prefetch"]
            fn = functools.partial(
                _wgmma_impl, kernel=kernel, launch=params["launch"], drop=pf.operands if pf else 0
            )
            return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    if prefers_dot(act, m, params["impl"], params["gemm_options"]):
        dq = dequant_kernel(n, k, params["gemm_options"])
        if dq is not None:
            pf = params["prefetch"]
            fn = functools.partial(
                _dot_impl, k=k, kernel=dq, drop=pf.operands if pf else 0,
                dot_x=params["gemm_options"].dot_x,
            )  # fmt: skip
            return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
        return _lower_gpu_reference(ctx, *args, **params)  # chosen, not a fallback: no note
    kind, supported = _supported(
        act, m, n, k, ctx.avals_in[0].dtype, params["gemm_options"], params["gw_rows"]
    )
    kernel = None
    if supported[0] and params["impl"] != "ref":
        try:
            if kind == "gemm":
                kernel = nvfp4_gemm.build(
                    m,
                    n,
                    k,
                    options=params["gemm_options"],
                    gw_rows=params["gw_rows"],
                    residual=params["residual"],
                )
            else:
                kernel = nvfp4_gemv.build(
                    act,
                    m,
                    n,
                    k,
                    options=params["options"],
                    gw_rows=params["gw_rows"],
                    residual=params["residual"],
                    prefetch=params["prefetch"],
                )
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"{kind} build failed: {err}")
    if not _dispatch.use_kernel(OP, params["impl"], supported):
        return _lower_gpu_reference(ctx, *args, **params)
    if kind == "gemm":
        # the GEMM takes no prefetch operands (hints only): dropped
        pf = params["prefetch"]
        fn = functools.partial(
            _gemm_impl, kernel=kernel, launch=params["launch"], drop=pf.operands if pf else 0
        )
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    if params["launch"] == "ptx":
        return _dispatch.lower_ptx(ctx, *args, backend_config=kernel.backend_config())
    return mlir.lower_fun(functools.partial(_callback_impl, kernel=kernel), multiple_results=False)(
        ctx, *args
    )


mlir.register_lowering(_gemv_p, _lower_reference)
mlir.register_lowering(_gemv_p, _lower_cuda, platform="cuda")


def _callback_impl(*args, kernel):
    from jax.experimental.buffer_callback import buffer_callback

    m = args[0].shape[0]
    out = jax.ShapeDtypeStruct((m, kernel.n), jnp.bfloat16)
    return buffer_callback(kernel.launch_callback, out, command_buffer_compatible=True)(*args)


# The GEMM's x_hat operand is K-permuted within each 128-element chunk (see nvfp4_gemm.cu):
#   x_perm[m, 128c + 32u + 8t + j] = x_hat[m, 128c + 32t + 8u + j // 2 + 4 (j % 2)]
_GEMM_CHUNK = 128


def gemm_x_operand(xp: jax.Array, xs: jax.Array) -> jax.Array:
    """The GEMM's activation operand: x_hat = e2m1(code) * SFx (no global scale) as float16
    [M, K], exact (<= 6 significant bits, 2^-10 .. 2688), in the kernel's K order.

    Args:
        xp: uint8 [M, K/2] activation codes; xs: uint8 [M, K/16] E4M3 block scale bytes.
    """
    m, k = xp.shape[0], 2 * xp.shape[1]
    xq = Nvfp4Tensor(packed=xp, scales=_as_e4m3(xs), global_scale=jnp.ones((), jnp.float32),
                     shape=(m, k))  # fmt: skip
    xh = nvfp4._scaled_values(xq).astype(jnp.float16)  # [M, K]
    # [M, C, t, u, jh, jl] -> [M, C, u, t, jl, jh]
    xh = xh.reshape(m, k // _GEMM_CHUNK, 4, 4, 2, 4).transpose(0, 1, 3, 2, 5, 4)
    return xh.reshape(m, k)


def gemm_x_values(xh: jax.Array) -> jax.Array:
    """The inverse of `gemm_x_operand`'s K order: x_hat [M, K] in the GEMM's order -> the same
    values e2m1 * SFx in natural K order (float16 [M, K])."""
    m, k = xh.shape
    xv = xh.reshape(m, k // _GEMM_CHUNK, 4, 4, 4, 2).transpose(0, 1, 3, 2, 5, 4)
    return xv.reshape(m, k)


def gemm_finish(
    partials: jax.Array,
    xg: jax.Array,
    wg: jax.Array,
    layer: jax.Array,
    stacked: bool,
    w_shift: int = nvfp4_gemm.DEFAULT_W_SHIFT,
):
    """What the GEMM's split-K epilogue kernel (`nvfp4_gemm_finish`) computes, in JAX (its
    reference twin): bf16 [M, N] from float32 partial sums [S, M, N], added in split order, times
    2^(14 - w_shift) (undoing the kernel's fp16 weight offset) and global_w * global_x, as the
    main kernel's own epilogue. wg: [] / [N], or stacked [L] / [L, N] with `layer` selecting."""
    acc = partials[0]
    for s in range(1, partials.shape[0]):
        acc = acc + partials[s]
    g = jax.lax.dynamic_index_in_dim(wg, layer, axis=0, keepdims=False) if stacked else wg
    alpha = (g[None, :] if g.ndim == 1 else g) * xg[:, None]
    return ((acc * jnp.float32(2.0 ** (14 - w_shift))) * alpha).astype(jnp.bfloat16)


def _gemm_impl(*args, kernel, launch, drop=0):
    args = args[: len(args) - drop]
    # (xp, xs, xg, wp, ws, wg, layer), res [M, N] after xg with the residual
    xp, xs, xg, *res, wp, ws, wg, layer = args
    xh = gemm_x_operand(xp, xs)
    return _gemm_on_xhat(xh, xg, res, wp, ws, wg, layer, kernel=kernel, launch=launch)


def _gemm_on_xhat(xh, xg, res, wp, ws, wg, layer, *, kernel, launch):
    """The GEMM's launches on its x_hat operand: the GEMM entry, then with a K split through
    partials the finish entry (`kernel.entry`, `kernel.finish_entry`: the mma.sync GEMM's or the
    wgmma GEMM's); `res` is [] or [the residual operand]."""
    p = kernel.plan

    def call(entry, out, *ops):
        if launch == "ptx":
            return _dispatch.ptx_call(kernel.backend_config(entry), out, *ops)
        from jax.experimental.buffer_callback import buffer_callback

        return buffer_callback(kernel.callback(entry), out, command_buffer_compatible=True)(*ops)

    y = jax.ShapeDtypeStruct((p.m, p.n), jnp.bfloat16)
    if not p.partials:
        return call(kernel.entry, y, xh, xg, *res, wp, ws, wg, layer)
    part = jax.ShapeDtypeStruct(p.out_shape, jnp.float32)
    part = call(kernel.entry, part, xh, xg, *res, wp, ws, wg, layer)
    return call(kernel.finish_entry, y, part, xg, *res, wg, layer)


def gemm_call_xhat(
    xh: jax.Array,
    xg: jax.Array,
    wp: jax.Array,
    ws: jax.Array,
    wg: jax.Array,
    layer: jax.Array,
    *,
    n: int,
    gw_rows: bool = False,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    residual: jax.Array | None = None,
    launch: str = "ptx",
) -> jax.Array:
    """The W4A4 GEMM on an x_hat operand that is already built (as `gemm_x_operand` gives it,
    e.g. by the quantizer kernel's "xhat" form, `cuda_ops.nvfp4_quant`): the launches of the
    GEMM path of `gemv_call` without the XLA fusion that builds x_hat from codes and scales;
    the same kernels, so the same bits. For CUDA lowering rules only (called inside one's
    `mlir.lower_fun`): it emits the kernel calls and has no reference.

    Args:
        xh: float16 [M, K], x_hat = e2m1 * SFx in the GEMM's K order.
        xg: float32 [M], the activation global scale per row.
        wp, ws, wg, layer: the weight operands as in `gemv_call` (stack dims kept).
        n: out features.
        gw_rows: the weight's global scale is per row.
        gemm_options: the GEMM choices (`nvfp4_gemm.GemmOptions`).
        residual: bf16 [M, N] added in the GEMM's (or its split-K finish's) epilogue, y =
            residual + linear (XLA's bf16 add); None: no residual.
        launch: "ptx" or "callback" (as `gemv_call`).

    Raises KernelError when the GEMM cannot be built for this shape, ValueError on operands of
    the wrong shape or dtype.
    """
    m, k = xh.shape
    if np.dtype(xh.dtype) != np.dtype(np.float16) or tuple(xg.shape) != (m,):
        got = f"xh {xh.shape} {np.dtype(xh.dtype)}, xg {xg.shape}"
        raise ValueError(f"{got}: expected float16 [M, K] and float32 [M]")
    res = []
    if residual is not None:
        if tuple(residual.shape) != (m, n) or np.dtype(residual.dtype) != np.dtype(jnp.bfloat16):
            raise ValueError(
                f"residual {residual.shape} {np.dtype(residual.dtype)}, expected ({m}, {n}) bf16"
            )
        res = [residual]
    kernel = nvfp4_gemm.build(
        m, n, k, options=gemm_options, gw_rows=gw_rows, residual=residual is not None
    )
    return _gemm_on_xhat(xh, xg, res, wp, ws, wg, layer, kernel=kernel, launch=launch)


# ----------------------------------------------------------------------------- wgmma GEMM


def takes_wgmma(act: str, m: int, impl: str, gemm_options: nvfp4_gemm.GemmOptions) -> bool:
    """Whether a W4A4 linear of M rows asks for the warpgroup-MMA GEMM first
    (`GemmOptions.wgmma_min_m` .. `wgmma_max_m` rows; impl "auto" or "cuda")."""
    low, high = gemm_options.wgmma_min_m, gemm_options.wgmma_max_m
    if act != "w4a4" or impl == "ref" or low is None or m < low:
        return False
    return high is None or m <= high


@functools.cache
def _note_no_wgmma(why: str) -> None:
    """Logs once per reason that the wgmma GEMM was asked for and not built: the usual dispatch
    (GEMM, GEMV or the dot) runs instead, so not a reference path."""
    warnings.warn(f"{OP}: the wgmma GEMM does not run: {why}", stacklevel=3)


def _default_wgmma_range(gemm_options: nvfp4_gemm.GemmOptions) -> bool:
    return (gemm_options.wgmma_min_m, gemm_options.wgmma_max_m) == (
        nvfp4_gemm.DEFAULT_WGMMA_MIN_M,
        nvfp4_gemm.DEFAULT_WGMMA_MAX_M,
    )


def wgmma_kernel(m: int, n: int, k: int, gemm_options: nvfp4_gemm.GemmOptions, gw_rows: bool):
    """The wgmma GEMM for one W4A4 problem (`nvfp4_gemm_wgmma.build_linear` with
    `gemm_options.wgmma_tm`, `wgmma_raster`, `w_shift` and `split_m`), or None where it cannot
    be built (off
    sm_90, K not a multiple of 128, no NVRTC): logged once where the options chose a wgmma
    range other than the default, silent for the default (the usual dispatch runs)."""
    try:
        return nvfp4_gemm_wgmma.build_linear(
            m,
            n,
            k,
            tm=gemm_options.wgmma_tm,
            gw_rows=gw_rows,
            w_shift=gemm_options.w_shift,
            split_m=gemm_options.split_m,
            raster=gemm_options.wgmma_raster,
        )
    except nvfp4_gemv.KernelError as err:
        if not _default_wgmma_range(gemm_options):
            _note_no_wgmma(f"M={m} N={n} K={k}: {err}")
        return None


def wgmma_call(xp, xs, xg, wp, ws, wg, layer, *, kernel, launch: str = "ptx") -> jax.Array:
    """y [M, N] bf16 of the wgmma GEMM `kernel` on activation codes (xp uint8 [M, K/2], xs
    uint8 [M, K/16], xg float32 [M]) and the weight operands (stack dims kept): its x_hat
    operand (`nvfp4_gemm_wgmma.wgmma_x_operand`, XLA ops; pre-tiled by `to_stage_tiles` for a
    kernel whose stage copies are bulk copies), the GEMM, with a K split its finish.
    For CUDA lowering rules only (inside `mlir.lower_fun`)."""
    xh = nvfp4_gemm_wgmma.wgmma_x_operand(xp, xs)
    if kernel.plan.bulk:
        xh = nvfp4_gemm_wgmma.to_stage_tiles(xh, kernel.plan.tm, kernel.plan.kt)
    return _gemm_on_xhat(xh, xg, [], wp, ws, wg, layer, kernel=kernel, launch=launch)


def wgmma_call_xhat(xt, xg, wp, ws, wg, layer, *, kernel, launch: str = "ptx") -> jax.Array:
    """y [M, N] bf16 of the wgmma GEMM `kernel` (BULK) on x_hat stage tiles that are already
    built (`nvfp4_gemm_wgmma.to_stage_tiles` of its `wgmma_x_operand`, e.g. by the quantizer
    kernel's "xhat_tiles" form) and the global scale xg float32 [M]: its launches only. For
    CUDA lowering rules only."""
    return _gemm_on_xhat(xt, xg, [], wp, ws, wg, layer, kernel=kernel, launch=launch)


def _wgmma_impl(*args, kernel, launch, drop=0):
    args = args[: len(args) - drop]
    # (xp, xs, xg, wp, ws, wg, layer), res [M, N] after xg with the residual: XLA's bf16 add,
    # the same bits as the GEMM epilogue's
    xp, xs, xg, *res, wp, ws, wg, layer = args
    y = wgmma_call(xp, xs, xg, wp, ws, wg, layer, kernel=kernel, launch=launch)
    return res[0] + y if res else y


# ----------------------------------------------------------------------------- dot path


def dequant_kernel(n: int, k: int, gemm_options: nvfp4_gemm.GemmOptions):
    """The dequantizer kernel of the dot path for an [n, k] weight where
    `gemm_options.dot_dequant` asks for it, else None (XLA's decode; a failed build is logged
    once and XLA's decode runs: the same bytes)."""
    if gemm_options.dot_dequant != "kernel":
        return None
    try:
        kernel = nvfp4_dequant.build(n, k)
    except nvfp4_gemv.KernelError as err:
        warnings.warn(f"{OP}: the dequantizer kernel does not run (N={n} K={k}): {err}",
                      stacklevel=3)  # fmt: skip
        return None
    if gemm_options.dot_stream != kernel.stream:
        kernel = dataclasses.replace(kernel, stream=gemm_options.dot_stream)
    return kernel


def dequant_call(wp, ws, layer, *, kernel) -> jax.Array:
    """bf16 [N, K] = e2m1 * SFw of the layer's weight from the (possibly stacked) operands, the
    dequantizer kernel reading the stack in place. With `kernel.stream` "side"
    (`GemmOptions.dot_stream`) the call is marked for XLA's stream 1 (`_dispatch.on_gpu_stream`), which XLA
    runs as an async start / done pair, free to overlap earlier work on the compute stream.
    For CUDA lowering rules only."""
    if wp.ndim == 2:
        wp, ws, layer = wp[None], ws[None], jnp.zeros((), jnp.int32)
    out = jax.ShapeDtypeStruct((kernel.n, kernel.k), jnp.bfloat16)

    def call(wp, ws, layer):
        return _dispatch.ptx_call(kernel.backend_config(), out, wp, ws, layer)

    layer = jnp.asarray(layer, jnp.int32).reshape(())
    if kernel.stream == "side":
        return _dispatch.on_gpu_stream(call)(wp, ws, layer)
    return call(wp, ws, layer)


def layer_global(wg, layer, stacked: bool) -> jax.Array:
    """The layer's weight global scale ([] or [N]) from the (possibly stacked) operand."""
    return jax.lax.dynamic_index_in_dim(wg, layer, keepdims=False) if stacked else wg


def dot_with_kernel(
    xp, xs, xg, wp, ws, wg, layer, *, k: int, kernel, dot_x: str = "fused"
) -> jax.Array:
    """The W4A4 dot path (`nvfp4.nvfp4_matmul_q` order "dot") with the weight's bf16 values
    from the dequantizer kernel: the same values, so the same bits as XLA's decode. `dot_x`
    (`GemmOptions.dot_x`): "materialized" (and "kernel", which a plain linear's XLA codes
    cannot take) puts the activations' bf16 values behind an optimization barrier (XLA writes
    them once; the dot runs alone)."""
    m = xp.shape[0]
    xq = Nvfp4Tensor(packed=xp, scales=_as_e4m3(xs), global_scale=xg, shape=(m, k))
    values = dequant_call(wp, ws, layer, kernel=kernel)
    # "kernel" (a fused linear's quantizer kernel writes the values) reaches here only where
    # the codes come from XLA (plain linears): materialized as well
    return nvfp4.matmul_q_values(
        xq, values, layer_global(wg, layer, wp.ndim == 3), x_barrier=dot_x != "fused"
    )


def dot_with_values(xv, xg, wp, ws, wg, layer, *, kernel) -> jax.Array:
    """The dot path from the activations' exact bf16 values `xv` [M, K] and global scale `xg`
    [M] (the quantizer kernel's "xhat_bf16" form) and the dequantizer kernel's weight values:
    `nvfp4.matmul_x_values`, the same bits as `dot_with_kernel` on the same codes."""
    values = dequant_call(wp, ws, layer, kernel=kernel)
    return nvfp4.matmul_x_values(xv, xg, values, layer_global(wg, layer, wp.ndim == 3))


def _dot_impl(*args, k, kernel, drop=0, dot_x="fused"):
    args = args[: len(args) - drop]
    xp, xs, xg, *res, wp, ws, wg, layer = args
    y = dot_with_kernel(xp, xs, xg, wp, ws, wg, layer, k=k, kernel=kernel, dot_x=dot_x)
    return res[0] + y if res else y


# ----------------------------------------------------------------------------- dispatch


def prefers_dot(act: str, m: int, impl: str, gemm_options: nvfp4_gemm.GemmOptions) -> bool:
    """Whether the "auto" dispatch takes the dot reference by choice: W4A4 at M above
    `gemm_options.max_m` (prefill), where dequantizing the weight for one cuBLAS dot measured
    faster than the GEMM (`nvfp4_gemm.DEFAULT_MAX_M`)."""
    limit = gemm_options.max_m
    return impl == "auto" and act == "w4a4" and limit is not None and m > limit


def _supported(
    act: str,
    m: int,
    n: int,
    k: int,
    x_dtype,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    gw_rows: bool = False,
) -> tuple[str, tuple[bool, str]]:
    """(kernel kind "gemv" / "gemm", (ok, why)): the one kernel that M selects, and whether it
    handles this problem."""
    if m >= gemm_options.min_m and act == "w4a4":
        return "gemm", nvfp4_gemm.check_shape(m, n, k, gemm_options)
    if m > nvfp4_gemv.MAX_M and act != "w4a4":
        # W4A16 keeps the GEMV up to its M (also from min_m on); above it only the reference
        return "gemm", (False, f"act={act!r} at M={m} (the tensor-core GEMM is W4A4 only)")
    ok, why = nvfp4_gemv.check_shape(act, m, n, k)
    if ok and act == "w4a16" and np.dtype(x_dtype) != np.dtype(jnp.bfloat16):
        # the kernel reads bf16 activations; the reference keeps float32 inputs exact
        return "gemv", (False, f"x.dtype={np.dtype(x_dtype)} (the W4A16 kernel reads bfloat16)")
    return "gemv", (ok, why)


def supported(
    act: str,
    m: int,
    n: int,
    k: int,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """Whether a CUDA kernel (the GEMV or, from `gemm_options.min_m` on, the GEMM) handles this
    problem; (False, reason) otherwise."""
    return _supported(act, m, n, k, jnp.bfloat16, gemm_options)[1]


def gemv_call(
    args,
    *,
    act,
    n,
    k,
    impl,
    launch,
    gw_rows=False,
    options=nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options=nvfp4_gemm.DEFAULT_OPTIONS,
    order="auto",
    residual=None,
    prefetch=None,
):
    """Binds the primitive on flat kernel operands (see `_operands`).

    `residual` (W4A4 only): bf16 [M, N] added to the output, y = residual + linear (XLA's bf16
    add, as the reference runs it). The GEMV and the GEMM take it as an operand after xg and
    add it in their epilogue (no launch of its own).

    `prefetch` (W4A4 only): (`nvfp4_gemv.Prefetch`, [(codes, scales) of each target's stack])
    for the GEMV to prefetch into L2 (hints: the result is unchanged; the GEMM, the reference
    and the W4A16 GEMV ignore it).
    """
    if residual is not None:
        if act != "w4a4":
            raise ValueError(f"residual= is only for act='w4a4', got act={act!r}")
        m = args[0].shape[0]
        if tuple(residual.shape) != (m, n) or np.dtype(residual.dtype) != np.dtype(jnp.bfloat16):
            raise ValueError(
                f"residual {residual.shape} {np.dtype(residual.dtype)}, expected ({m}, {n}) bf16"
            )
        args = (*args[:3], residual, *args[3:])
    spec = None
    if prefetch is not None:
        spec, stacks = prefetch
        if act != "w4a4":
            raise ValueError(f"prefetch= is only for act='w4a4', got act={act!r}")
        if not isinstance(spec, nvfp4_gemv.Prefetch) or len(stacks) != len(spec.targets):
            raise ValueError(
                f"prefetch=(spec, stacks) needs a Prefetch and one (codes, scales) per target, "
                f"got {type(spec).__name__} with {len(stacks)} stacks"
            )
        for (codes, scales), t in zip(stacks, spec.targets, strict=True):
            want = ((t.layers, t.n, t.k // 2), (t.layers, t.n, t.k // 16))
            got = (tuple(codes.shape), tuple(scales.shape))
            if got != want or codes.dtype != jnp.uint8 or scales.dtype != jnp.uint8:
                raise ValueError(f"prefetch stack shapes {got}, expected uint8 {want}")
            args = (*args, codes, scales)
    return _gemv_p.bind(
        *args,
        act=act,
        n=n,
        k=k,
        impl=impl,
        launch=launch,
        gw_rows=gw_rows,
        options=options,
        gemm_options=gemm_options,
        order=order,
        residual=residual is not None,
        prefetch=spec,
    )


def _operands(x2: jax.Array, w: Nvfp4Tensor, act: str, input_scale: Any, layer: Any):
    """Flat kernel operands: W4A4 (xp, xs, xg[M], wp, ws, wg, layer); W4A16 (x, wp, ws, wg,
    layer). wp / ws / wg keep the weight's stack dim; layer is int32 []."""
    wp = w.packed
    ws = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    wg = jnp.asarray(w.global_scale, jnp.float32)
    li = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    if act == "w4a16":
        return (x2, wp, ws, wg, li)
    xq = nvfp4.quantize_activation(x2, input_scale)
    m = x2.shape[0]
    xg = jnp.broadcast_to(jnp.asarray(xq.global_scale, jnp.float32), (m,))
    xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
    return (xq.packed, xs, xg, wp, ws, wg, li)


def _check_args(x: Any, w: Any, act: str, impl: str, input_scale: Any, layer: Any) -> None:
    if act not in ACTS:
        raise ValueError(f"act={act!r}, expected one of {ACTS}")
    _dispatch.check_impl(impl)
    if not isinstance(w, Nvfp4Tensor):
        raise ValueError(f"w must be an Nvfp4Tensor, got {type(w).__name__}")  # noqa: TRY004
    if len(w.stack) > 1:
        raise ValueError(f"w has stack dims {w.stack}; nvfp4_linear takes one matrix or one stack")
    if w.stack and layer is None:
        raise ValueError(f"w is a stack of {w.stack[0]} matrices: pass layer=<index>")
    if not w.stack and layer is not None:
        raise ValueError("layer= is only used with a stacked weight (packed [L, N, K/2])")
    nvfp4._check_tensor("w", w, stacked=True)
    shape = tuple(np.shape(x))
    if len(shape) < 1 or shape[-1] != w.k:
        raise ValueError(f"x.shape={shape} must end in K={w.k} (w.shape={w.shape})")
    if np.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"x.dtype={np.dtype(x.dtype)}, expected bfloat16, float16 or float32")
    if act == "w4a16" and input_scale is not None:
        raise ValueError("input_scale is only used with act='w4a4'; got one with act='w4a16'")


def nvfp4_linear(
    x: jax.Array,
    w: Nvfp4Tensor,
    *,
    input_scale: Any = None,
    act: str = "w4a4",
    impl: str = "auto",
    layer: Any = None,
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> jax.Array:
    """NVFP4 linear y = x @ w.T with the reference numerics of `rejax.nvfp4.nvfp4_matmul`.

    Args:
        x: [..., K] bfloat16 (float16 / float32 accepted); leading dims fold into M.
        w: Nvfp4Tensor of shape (N, K) (global scale [] or per row [N]), or a stack of them
            (packed [L, N, K/2], global scale [L] or [L, N]) with `layer` selecting one.
        input_scale: W4A4 static activation global scale (f32 scalar); None -> per-row dynamic.
        act: "w4a4" (activations quantized to NVFP4) or "w4a16" (bf16 activations).
        impl: "auto" (kernel on CUDA when supported, else reference), "ref", or "cuda" (kernel
            or an error saying why not).
        layer: int or int32 [] index into a stacked w (may be traced).
        options: GEMV choices (cuda_ops.nvfp4_gemv.GemvOptions; defaults measured fastest).
        gemm_options: GEMM choices (cuda_ops.nvfp4_gemm.GemmOptions), including `min_m`, the
            smallest M that takes the GEMM instead of the GEMV.

    Returns:
        bfloat16 [..., N].
    """
    _check_args(x, w, act, impl, input_scale, layer)
    lead = tuple(np.shape(x)[:-1])
    m = int(np.prod(lead, dtype=np.int64))
    n, k = w.shape
    if m == 0:
        return jnp.zeros((*lead, n), jnp.bfloat16)
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004
    if impl == "cuda":
        ok, why = _supported(act, m, n, k, x.dtype, gemm_options, w.per_row)[1]
        if not ok:
            raise ValueError(f"nvfp4_linear(impl='cuda'): {why}")
    x2 = jnp.reshape(x, (m, k))  # [M, K]
    args = _operands(x2, w, act, input_scale, layer)
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    y = gemv_call(
        args,
        act=act,
        n=n,
        k=k,
        impl=impl,
        launch=launch,
        gw_rows=w.per_row,
        options=options,
        gemm_options=gemm_options,
    )
    return jnp.reshape(y, (*lead, n))
