"""Fused NVFP4 W4A4 decode linears: RMSNorm or SwiGLU in front, the residual add behind, and the
activation quantization inside the GEMV.

GEMM letters as in rejax/ops/linear.py (M rows of x, N out features, K in features). One
primitive covers the decoder's four linears:

    qkv     = fused_linear(x, qkv_proj, prologue="rmsnorm", norm=input_layernorm)
    x       = fused_linear(attn_out, o_proj, residual=x)
    gate_up = fused_linear(x, gate_up_proj, prologue="rmsnorm", norm=post_attention_layernorm)
    x       = fused_linear(gate_up, down_proj, prologue="swiglu", residual=x)

A fused op is a speed choice, never a numerics one: its reference is the composition of the
unfused functions (`rejax.layers.rms_norm` / `swiglu`, `rejax.nvfp4.nvfp4_matmul` with
`quantize_activation`, a bf16 add), so on CPU the fused decoder is bitwise the unfused one. On
CUDA, M <= 8 runs `cuda_ops/nvfp4_gemv.cu`'s `nvfp4_gemv_w4a4_bf16` (one launch: prologue,
quantization with the reference's exact divisions, GEMV, residual); the kernel's RMSNorm sums
the mean square in another order than XLA, so its output may differ from the composition by
that rounding. With `kernels="two"` the prologue and the quantizer run once, in
`nvfp4_quantize_bf16` (cuda_ops/nvfp4_quant.py, rows split over the grid, the same device
code), and the plain W4A4 GEMV (from `gemm_options.min_m` on, the GEMM) reads its codes; with
`residual_epilogue=True` it also adds the residual in its epilogue (built with -DEPI_RES=1: the
composition's bf16 add, which tests/test_quant_kernel_gpu.py checks bitwise), so no add runs as
a launch of its own, else the add is an XLA op. The quantizer kernel takes any number of rows;
with `gemm_options.x_quant` "kernel" (the default; "xla" keeps XLA's quantizer) for the GEMM (from
`gemm_options.min_m` on: decode batches, prefill up to `max_m`) it is built in its "xhat" form
and writes the GEMM's fp16 operand x_hat (e2m1 * SFx in the GEMM's K order,
`rejax.ops.linear.gemm_x_operand` of its codes and scales, bit for bit) and the global scale,
which the GEMM reads directly (`rejax.ops.linear.gemm_call_xhat`): no XLA op builds the
operand. So for prologue "none" the output is bitwise the composition's; "rmsnorm" sums the
mean square in the kernel's order and "swiglu" takes CUDA's expf, so a few bf16 inputs of the
quantizer may round the other way, as at M <= 8. With "xla", or where that form does not build
(K % 256 != 0, a failed build; logged once), the lowering is the one from before it:
`gemm_x_operand` as an XLA op after the quantizer kernel's codes form up to 8 rows, and above
them after the reference's XLA prologue and quantizer (`quantize_activation` itself, the
unfused composition's own operations), then the same GEMM. `kernels="one"` takes that two-step
lowering too where its one launch does not serve the shape (M > 8). Only where the linear itself has no kernel (an
unsupported shape, a failed build, `impl="ref"`, the buffer_callback launch with two steps) does
the whole op lower to the composition with one bf16 tensor-core dot, the reason logged once.

Two more entry points serve the kernels that write a linear's NVFP4 input themselves, so the
quantizer launch in front of it goes: `linear_from_codes` (the plain W4A4 GEMV, and the
residual, on given codes, scales and global scale: o_proj after
`rejax.ops.decode_attention.decode_attention_nvfp4`, down_proj after the next) and
`fused_linear_swiglu` (gate_up_proj with the RMSNorm prologue whose GEMV's SwiGLU epilogue
writes down_proj's NVFP4 input; the same bytes as the "split" path's quantizer). Two more
serve `Config.o_proj_output` "nvfp4": `linear_norm_out` (o_proj's residual GEMV whose last CTA
also writes gate_up's NVFP4 input, the quantizer kernel's bytes of rms_norm(y)) and
`linear_swiglu_from_codes` (`fused_linear_swiglu` on given codes). The decoder takes them under
`Config.attention_output` / `Config.gate_up_output` / `Config.o_proj_output` "nvfp4".
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import layers, nvfp4
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch
from rejax.ops.linear import (
    _supported,
    _weight,
    dequant_kernel,
    dot_with_kernel,
    dot_with_values,
    gemm_call_xhat,
    gemm_x_operand,
    gemv_call,
    prefers_dot,
    takes_wgmma,
    wgmma_call,
    wgmma_call_xhat,
    wgmma_kernel,
)

OP = "nvfp4_fused_linear"
_LOG = logging.getLogger("rejax.ops")
PROLOGUES = nvfp4_gemv.PROLOGUES
KERNELS = ("one", "two")  # CUDA launches per fused linear (see the module docstring)


# ----------------------------------------------------------------------------- reference


def _prologue(x, nw, layer, *, k, fused):
    """The linear's input from the primitive's x (the unfused rms_norm / swiglu)."""
    if fused.prologue == "rmsnorm":
        scale = layers.take(nw, layer) if fused.norm_stacked else nw
        return layers.rms_norm(x, scale, fused.eps)
    if fused.prologue == "swiglu":
        return layers.swiglu(x[:, :k], x[:, k:])
    return x


def _static_scale(xg, layer, fused):
    """The input scale the kernel reads: None (dynamic), xg[layer] (stacked [L]) or xg[0]."""
    if fused.dynamic:
        return None
    return layers.take(xg, layer) if fused.scale_stacked else xg[0]


def _reference(x, xg, nw, res, wp, ws, wg, layer, *_pf, n, k, fused, order="auto", **_: Any):
    """The unfused composition on the primitive's operands (see `fused_linear`; the prefetch
    operands after `layer` are hints and take no part)."""
    h = _prologue(x, nw, layer, k=k, fused=fused)
    scale = _static_scale(xg, layer, fused)
    w = _weight(wp, ws, wg, layer, n, k)
    y = nvfp4.nvfp4_matmul(h.astype(jnp.bfloat16), w, act="w4a4", input_scale=scale, order=order)
    return res + y if fused.residual else y


# ----------------------------------------------------------------------------- primitive

_fused_p = Primitive("rejax_nvfp4_fused_linear")
_fused_p.def_abstract_eval(
    lambda x, *_, n, **__: jax.core.ShapedArray((x.shape[0], n), jnp.bfloat16)
)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_fused_p.bind, **params))


_fused_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _lower_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_reference, **params)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


# ----------------------------------------------------------------------------- quantizer alone


def _quant_reference(x, xg, nw, layer, *, k, fused):
    """(codes uint8 [M, K/2], scales uint8 [M, K/16], global scale f32 [M]) of the prologue's
    output, as `rejax.nvfp4.quantize_activation` gives them."""
    h = _prologue(x, nw, layer, k=k, fused=fused).astype(jnp.bfloat16)
    q = nvfp4.quantize_activation(h, _static_scale(xg, layer, fused))
    xs = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    return q.packed, xs, jnp.broadcast_to(jnp.asarray(q.global_scale, jnp.float32), (h.shape[0],))


def _quantizer_primitive(name: str, outs, reference) -> Primitive:
    """A primitive for one output form of the quantizer kernel: `outs(x, k, **params)` gives its
    output avals; on CUDA with a built `kernel` it lowers to that kernel's PTX call, otherwise
    (or kernel None) to `reference(x, xg, nw, layer, k=..., fused=..., ...)`, the form's values
    as XLA ops. Bound with `kernel`, `k`, `fused` (and the form's own parameters)."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(lambda x, *_, k, kernel, fused, **params: outs(x, k, **params))

    def lower_reference(ctx, *args, kernel, **params):
        del kernel
        return mlir.lower_fun(functools.partial(reference, **params), multiple_results=True)(
            ctx, *args
        )

    def lower_cuda(ctx, *args, kernel, **params):
        if kernel is None:  # bound only with a built kernel by the callers; else the reference
            return lower_reference(ctx, *args, kernel=None, **params)
        return _dispatch.lower_ptx(ctx, *args, backend_config=kernel.backend_config())

    mlir.register_lowering(prim, lower_reference)
    mlir.register_lowering(prim, lower_cuda, platform="cuda")
    return prim


def _values_and_scales(dtype):
    """The output avals of the x_hat forms with values [M, K] in `dtype`: (x_hat, the global
    scale f32 [M])."""
    return lambda x, k: (
        jax.core.ShapedArray((x.shape[0], k), dtype),
        jax.core.ShapedArray((x.shape[0],), jnp.float32),
    )


# the quantizer's "codes" form (the GEMV's operands: codes, scales, global scale per row)
_quant_p = _quantizer_primitive(
    "rejax_nvfp4_quantize",
    lambda x, k: (
        jax.core.ShapedArray((x.shape[0], k // 2), jnp.uint8),
        jax.core.ShapedArray((x.shape[0], k // nvfp4.BLOCK), jnp.uint8),
        jax.core.ShapedArray((x.shape[0],), jnp.float32),
    ),
    _quant_reference,
)


def _xhat_reference(x, xg, nw, layer, *, k, fused):
    """(x_hat float16 [M, K] in the GEMM's K order, global scale f32 [M]): `gemm_x_operand` of
    `_quant_reference`'s codes and scales, what the quantizer kernel's "xhat" form writes."""
    xp, xs, xgr = _quant_reference(x, xg, nw, layer, k=k, fused=fused)
    return gemm_x_operand(xp, xs), xgr


# the quantizer in its "xhat" form (the GEMM's operand); bound only by _two_kernels with a kernel
_quant_xhat_p = _quantizer_primitive(
    "rejax_nvfp4_quantize_xhat", _values_and_scales(jnp.float16), _xhat_reference
)


def _xbf16_reference(x, xg, nw, layer, *, k, fused):
    """(the activations' values e2m1 * SFx as bf16 [M, K] in natural K order, global scale f32
    [M]): `_quant_reference`'s codes and scales decoded, what the quantizer kernel's
    "xhat_bf16" form writes."""
    xp, xs, xgr = _quant_reference(x, xg, nw, layer, k=k, fused=fused)
    xq = nvfp4.Nvfp4Tensor(
        packed=xp, scales=jax.lax.bitcast_convert_type(xs, jnp.float8_e4m3fn),
        global_scale=xgr, shape=(x.shape[0], k),
    )  # fmt: skip
    return nvfp4.scaled_values_bf16(xq), xgr


# the quantizer in its "xhat_bf16" form (the dot path's activations); bound only by
# _dot_composed with a kernel
_quant_xbf16_p = _quantizer_primitive(
    "rejax_nvfp4_quantize_xhat_bf16", _values_and_scales(jnp.bfloat16), _xbf16_reference
)


def _tiles_reference(x, xg, nw, layer, *, k, fused, tile_m):
    """(the wgmma GEMM's x_hat stage tiles float16 [ceil(M / tile_m), K / 128, tile_m * 128],
    global scale f32 [M]): `to_stage_tiles(wgmma_x_operand(...))` of `_quant_reference`'s
    codes and scales, what the quantizer kernel's "xhat_tiles" form writes."""
    from cuda_ops import nvfp4_gemm_wgmma

    xp, xs, xgr = _quant_reference(x, xg, nw, layer, k=k, fused=fused)
    xh = nvfp4_gemm_wgmma.wgmma_x_operand(xp, xs)
    return nvfp4_gemm_wgmma.to_stage_tiles(xh, tile_m, 128), xgr


# the quantizer in its "xhat_tiles" form (the wgmma GEMM's operand); bound only by
# _wgmma_composed with a kernel
_quant_tiles_p = _quantizer_primitive(
    "rejax_nvfp4_quantize_xhat_tiles",
    lambda x, k, tile_m: (
        jax.core.ShapedArray((-(-x.shape[0] // tile_m), k // 128, tile_m * 128), jnp.float16),
        jax.core.ShapedArray((x.shape[0],), jnp.float32),
    ),
    _tiles_reference,
)


@functools.cache
def _note_no_xhat(why: str) -> None:
    """Logs once per reason that the GEMM's x_hat is built by XLA ops (`gemm_x_operand`), not by
    the quantizer kernel: not a reference path, the GEMM still runs."""
    _LOG.warning("%s: XLA builds the GEMM's x_hat: %s", OP, why)


def _two_kernels(
    x, xg, nw, res, wp, ws, wg, layer, *pf_stacks, n, k, fused, quant, options, gemm_options,
    gw_rows, epilogue, prefetch=None,
):  # fmt: skip
    """The quantizer (its kernel, or with `quant` None its reference as XLA ops), then the plain
    W4A4 linear (GEMV or GEMM) on its codes, which adds the residual in its epilogue
    (`rejax.ops.linear.gemv_call`) with `epilogue`, else after it; the GEMV issues the
    `prefetch` hints (the GEMM drops them). A `quant` kernel of the "xhat" form writes the
    GEMM's x_hat, and the GEMM reads it (`rejax.ops.linear.gemm_call_xhat`, CUDA only)."""
    pro = dataclasses.replace(fused, residual=False)
    in_kernel = fused.residual and epilogue
    if quant is not None and quant.out == "xhat":
        xh, xgr = _quant_xhat_p.bind(x, xg, nw, layer, k=k, fused=pro, kernel=quant)
        y = gemm_call_xhat(
            xh,
            xgr,
            wp,
            ws,
            wg,
            layer,
            n=n,
            gw_rows=gw_rows,
            gemm_options=gemm_options,
            residual=res if in_kernel else None,
        )
        return res + y if fused.residual and not in_kernel else y
    pf = None
    if prefetch is not None:
        pairs = tuple(zip(pf_stacks[0::2], pf_stacks[1::2], strict=True))
        pf = (prefetch, pairs)
    xp, xs, xgr = _quant_p.bind(x, xg, nw, layer, k=k, fused=pro, kernel=quant)
    y = gemv_call(
        (xp, xs, xgr, wp, ws, wg, layer),
        act="w4a4",
        n=n,
        k=k,
        impl="cuda",
        launch="ptx",
        gw_rows=gw_rows,
        options=options,
        gemm_options=gemm_options,
        residual=res if in_kernel else None,
        prefetch=pf,
    )
    return res + y if fused.residual and not in_kernel else y


def _wgmma_composed(
    x, xg, nw, res, wp, ws, wg, layer, *_pf, n, k, fused, kernel, launch, quant=None
):  # fmt: skip
    """In the wgmma range (`GemmOptions.wgmma_min_m` .. `wgmma_max_m` rows): the prologue and
    quantizer as XLA ops (the reference's own), the wgmma GEMM on their codes; or with `quant`
    (`GemmOptions.wgmma_x_quant` "kernel") the quantizer kernel's "xhat_tiles" form writing
    the GEMM's x_hat stage tiles. The residual as XLA's bf16 add."""
    del n
    pro = dataclasses.replace(fused, residual=False)
    if quant is not None:
        xt, xgr = _quant_tiles_p.bind(
            x, xg, nw, layer, k=k, fused=pro, kernel=quant, tile_m=quant.tile_m
        )
        y = wgmma_call_xhat(xt, xgr, wp, ws, wg, layer, kernel=kernel, launch=launch)
    else:
        xp, xs, xgr = _quant_reference(x, xg, nw, layer, k=k, fused=pro)
        y = wgmma_call(xp, xs, xgr, wp, ws, wg, layer, kernel=kernel, launch=launch)
    return res + y if fused.residual else y


def _wgmma_quant(m: int, k: int, fused, kernel, gemm_options):
    """The "xhat_tiles" quantizer kernel in front of the wgmma GEMM `kernel` where
    `gemm_options.wgmma_x_quant` is "kernel" (and the quantizer takes the shape), else None:
    XLA builds the tiles (a failed build logged once)."""
    if gemm_options.wgmma_x_quant != "kernel" or not nvfp4_quant.check_shape(m, k)[0]:
        return None
    try:
        pro = dataclasses.replace(fused, residual=False)
        return nvfp4_quant.build(m, k, pro, out="xhat_tiles", tile_m=kernel.plan.tm)
    except nvfp4_gemv.KernelError as err:
        _note_no_xhat(f"quantizer (xhat_tiles) build failed: {err}")
        return None


def _dot_quant(m: int, k: int, fused, gemm_options):
    """The "xhat_bf16" quantizer kernel in front of the dot path where `gemm_options.dot_x` is
    "kernel" (and the quantizer takes the shape), else None: XLA quantizes (a failed build
    logged once)."""
    if gemm_options.dot_x != "kernel" or not nvfp4_quant.check_shape(m, k)[0]:
        return None
    try:
        pro = dataclasses.replace(fused, residual=False)
        return nvfp4_quant.build(m, k, pro, out="xhat_bf16")
    except nvfp4_gemv.KernelError as err:
        _note_no_xhat(f"quantizer (xhat_bf16) build failed: {err}")
        return None


def _dot_composed(
    x, xg, nw, res, wp, ws, wg, layer, *_pf, n, k, fused, kernel, dot_x="fused", quant=None
):  # fmt: skip
    """Above `GemmOptions.max_m` with `dot_dequant` "kernel": the prologue and quantizer as XLA
    ops (the reference's), then the dot path with the dequantizer kernel's weight values (the
    reference's bits; `dot_x` as `GemmOptions.dot_x`); with `quant` (`dot_x` "kernel") the
    quantizer kernel's "xhat_bf16" form writes the activations' values instead (the same
    values, no XLA op on the activations)."""
    pro = dataclasses.replace(fused, residual=False)
    if quant is not None:
        xv, xgr = _quant_xbf16_p.bind(x, xg, nw, layer, k=k, fused=pro, kernel=quant)
        y = dot_with_values(xv, xgr, wp, ws, wg, layer, kernel=kernel)
        return res + y if fused.residual else y
    xp, xs, xgr = _quant_reference(x, xg, nw, layer, k=k, fused=pro)
    y = dot_with_kernel(xp, xs, xgr, wp, ws, wg, layer, k=k, kernel=kernel, dot_x=dot_x)
    return res + y if fused.residual else y


def _lower_two(ctx, *args, **params):
    m = ctx.avals_in[0].shape[0]
    n, k, fused = params["n"], params["k"], params["fused"]
    if takes_wgmma("w4a4", m, params["impl"], params["gemm_options"]):
        kernel = wgmma_kernel(m, n, k, params["gemm_options"], params["gw_rows"])
        if kernel is not None:
            quant = None
            if params["launch"] == "ptx" and params["impl"] != "ref":
                quant = _wgmma_quant(m, k, fused, kernel, params["gemm_options"])
            fn = functools.partial(
                _wgmma_composed, n=n, k=k, fused=fused, kernel=kernel, launch=params["launch"],
                quant=quant,
            )  # fmt: skip
            return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    if prefers_dot("w4a4", m, params["impl"], params["gemm_options"]):
        # above GemmOptions.max_m (prefill) the composition with one bf16 dot is the faster
        # path by measurement: chosen, so no reference-path note
        dq = dequant_kernel(n, k, params["gemm_options"])
        if dq is not None:
            quant = None
            if params["launch"] == "ptx" and params["impl"] != "ref":
                quant = _dot_quant(m, k, fused, params["gemm_options"])
            fn = functools.partial(
                _dot_composed, n=n, k=k, fused=fused, kernel=dq,
                dot_x=params["gemm_options"].dot_x, quant=quant,
            )  # fmt: skip
            return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
        fn = functools.partial(_reference, **{**params, "order": "dot"})
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    # the linear after the quantizer is the one the dispatch picks for M (GEMV or GEMM)
    kind, supported = _supported(
        "w4a4", m, n, k, jnp.bfloat16, params["gemm_options"], params["gw_rows"]
    )
    if supported[0] and params["launch"] != "ptx":
        supported = (False, f"launch={params['launch']!r} (the two-kernel path needs 'ptx')")
    # the quantizer kernel takes any M: in front of the GEMM its x_hat form with
    # GemmOptions.x_quant "kernel" (the default); with "xla" or without that form (a failed
    # build) the GEMM reads gemm_x_operand of the codes form up to the GEMV's rows and
    # above them of XLA's quantizer (the reference's own ops), the lowering from before the x_hat
    # form; in front of the GEMV the codes form. A failed build of the codes form or of the
    # linear fails the op: the dot reference.
    quant_kernel = nvfp4_quant.check_shape(m, k)[0]
    pro = dataclasses.replace(fused, residual=False)
    quant = None
    if supported[0] and params["impl"] != "ref":
        if kind == "gemm" and quant_kernel and params["gemm_options"].x_quant == "kernel":
            try:
                quant = nvfp4_quant.build(m, k, pro, out="xhat")
            except nvfp4_gemv.KernelError as err:
                _note_no_xhat(f"quantizer (xhat) build failed: {err}")
        try:
            if quant is None and quant_kernel and m <= nvfp4_gemv.MAX_M:
                quant = nvfp4_quant.build(m, k, pro)
            if kind == "gemm":
                nvfp4_gemm.build(
                    m,
                    n,
                    k,
                    options=params["gemm_options"],
                    gw_rows=params["gw_rows"],
                    residual=fused.residual and params["residual_epilogue"],
                )
            else:
                nvfp4_gemv.build(
                    "w4a4",
                    m,
                    n,
                    k,
                    options=params["options"],
                    gw_rows=params["gw_rows"],
                    residual=fused.residual and params["residual_epilogue"],
                )
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(OP, params["impl"], supported):
        # the composition, its matmul as one bf16 tensor-core dot (rejax/ops/linear.py)
        fn = functools.partial(_reference, **{**params, "order": "dot"})
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    fn = functools.partial(
        _two_kernels,
        n=n,
        k=k,
        fused=fused,
        quant=quant,
        options=params["options"],
        gemm_options=params["gemm_options"],
        gw_rows=params["gw_rows"],
        epilogue=params["residual_epilogue"],
        prefetch=params["prefetch"],
    )
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _lower_cuda(ctx, *args, **params):
    m = ctx.avals_in[0].shape[0]
    n, k = params["n"], params["k"]
    supported = nvfp4_gemv.check_shape("w4a4x", m, n, k)
    if params["kernels"] == "two" or not supported[0]:
        # kernels="one" on a shape its one launch does not serve (M > 8, say): the two-step
        # lowering, the linear M picks after the quantizer, rather than the dot reference
        return _lower_two(ctx, *args, **params)
    kernel = None
    if params["impl"] != "ref":
        try:
            kernel = nvfp4_gemv.build(
                "w4a4x",
                m,
                n,
                k,
                options=params["options"],
                gw_rows=params["gw_rows"],
                fused=params["fused"],
            )
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(OP, params["impl"], supported):
        # the composition, its matmul as one bf16 tensor-core dot (rejax/ops/linear.py)
        fn = functools.partial(_reference, **{**params, "order": "dot"})
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    drop = params["prefetch"].operands if params["prefetch"] is not None else 0
    if params["launch"] == "ptx" and not drop:
        return _dispatch.lower_ptx(ctx, *args, backend_config=kernel.backend_config())
    # the one-launch kernel takes no prefetch operands (hints only): dropped
    fn = functools.partial(_one_kernel, kernel=kernel, launch=params["launch"], drop=drop)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


def _one_kernel(*args, kernel, launch, drop):
    args = args[: len(args) - drop]
    if launch == "ptx":
        out = jax.ShapeDtypeStruct((args[0].shape[0], kernel.n), jnp.bfloat16)
        return _dispatch.ptx_call(kernel.backend_config(), out, *args)
    return _callback_impl(*args, kernel=kernel)


mlir.register_lowering(_fused_p, _lower_reference)
mlir.register_lowering(_fused_p, _lower_cuda, platform="cuda")


def _callback_impl(*args, kernel):
    from jax.experimental.buffer_callback import buffer_callback

    out = jax.ShapeDtypeStruct((args[0].shape[0], kernel.n), jnp.bfloat16)
    return buffer_callback(kernel.launch_callback, out, command_buffer_compatible=True)(*args)


# ----------------------------------------------------------------------------- API


def fusable(params: dict, quant: str | None) -> bool:
    """Whether a linear's params can take `fused_linear` (W4A4 NVFP4, one input scale, no bias)."""
    if quant != "nvfp4" or not isinstance(params.get("weight"), Nvfp4Tensor):
        return False
    if "bias" in params:
        return False
    scale = params.get("input_scale")
    return scale is None or (np.ndim(scale) <= 1 and not _per_shard(params))


def _per_shard(params: dict) -> bool:
    # input_scale [L, shards] (stacked) or [shards] (one matrix): one scale per fused shard
    scale, w = params.get("input_scale"), params["weight"]
    return scale is not None and np.ndim(scale) == len(w.stack) + 1


def fused_linear(
    x: jax.Array,
    params: dict,
    *,
    layer: Any = None,
    prologue: str = "none",
    norm: jax.Array | None = None,
    eps: float = 1e-6,
    residual: jax.Array | None = None,
    impl: str = "auto",
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    kernels: str = "one",
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    residual_epilogue: bool = False,
    prefetch: tuple = (),
    prefetch_options: nvfp4_gemv.Prefetch | None = None,
) -> jax.Array:
    """y = [residual +] nvfp4_linear(prologue(x)) as one op (on CUDA one kernel launch for
    M <= 8, or two with `kernels="two"`; for more rows XLA's prologue and quantizer, or with
    `gemm_options.x_quant` "kernel" the quantizer kernel writing the GEMM's x_hat, then the
    GEMM).

    Args:
        x: [..., K] bf16 (prologue "none" / "rmsnorm") or [..., 2K] (prologue "swiglu": the
            gate_up output, gate first).
        params: a W4A4 linear's params: {"weight": Nvfp4Tensor (N, K), stacked [L, ...] with
            `layer`, "input_scale" f32 [] / [L] (None: per-row dynamic)}; see `fusable`.
        layer: int32 [] index into stacked params (may be traced).
        prologue: "none", "rmsnorm" (rms_norm(x, norm, eps)) or "swiglu" (silu(gate) * up).
        norm: "rmsnorm": the norm weight [K] or a stack [L, K] (indexed by `layer`).
        eps: "rmsnorm": epsilon.
        residual: optional [..., N] bf16 added to the output (bf16 add).
        impl: "auto", "ref" or "cuda" (as `rejax.ops.linear.nvfp4_linear`).
        options: kernel choices.
        gemm_options: the GEMM choices of the linear after the quantizer (kernels="two", or an
            M the fused GEMV does not serve), including `min_m`, the fewest rows that take the
            GEMM instead of the GEMV.
        kernels: "one" (the fused GEMV) or "two" (the quantizer kernel, then the plain GEMV or
            GEMM); on CUDA only, the same reference elsewhere. Above M = 8 both are XLA's
            prologue and quantizer (or with `gemm_options.x_quant` "kernel" the quantizer
            kernel), then the linear M picks (the GEMM by default; with "kernel" reading the
            kernel's x_hat: prologue "none" bitwise the composition, "rmsnorm" / "swiglu" up
            to the rounding of a few of the quantizer's bf16 inputs, see the module
            docstring).
        residual_epilogue: with a residual on the two-step lowering (kernels="two", or an M
            the fused GEMV does not serve), the GEMV or GEMM adds it in its epilogue (no add
            of its own on CUDA; the same bf16 add). Off by default here; the decoder sets it
            from `Config.residual_fusion` (default "fused").
        prefetch: weights the plain W4A4 GEMV of the two-step lowering prefetches into L2
            while it runs (`cuda_ops.nvfp4_gemv.Prefetch`): up to two (stacked Nvfp4Tensor,
            layer delta, fraction of each row) entries, the stack's layer being `layer` +
            delta. Hints only: the result is unchanged, and the GEMM, the one-launch kernel
            and the reference ignore them. Used only with `prefetch_options`.
        prefetch_options: a `Prefetch` whose at / mode / evict_first apply (its targets are
            replaced by `prefetch`'s); None: no prefetch.

    Returns:
        bf16 [..., N].
    """
    _dispatch.check_impl(impl)
    if kernels not in KERNELS:
        raise ValueError(f"kernels={kernels!r}, expected one of {KERNELS}")
    if prologue not in PROLOGUES:
        raise ValueError(f"prologue={prologue!r}, expected one of {PROLOGUES}")
    if not fusable(params, "nvfp4"):
        raise ValueError(
            "fused_linear needs W4A4 NVFP4 params without a bias and with one input scale per "
            f"matrix (see fusable); got keys {sorted(params)}"
        )
    w: Nvfp4Tensor = params["weight"]
    if len(w.stack) > 1 or (w.stack and layer is None) or (not w.stack and layer is not None):
        raise ValueError(f"w stack {w.stack} with layer={layer!r}: pass layer= for a stack only")
    n, k = w.shape
    width = 2 * k if prologue == "swiglu" else k
    lead = tuple(np.shape(x)[:-1])
    if np.shape(x)[-1:] != (width,):
        raise ValueError(f"x.shape={np.shape(x)} must end in {width} for prologue={prologue!r}")
    for name, a in (("x", x), ("residual", residual)):
        if a is not None and np.dtype(a.dtype) != np.dtype(jnp.bfloat16):
            raise ValueError(f"{name}.dtype={np.dtype(a.dtype)}: fused_linear takes bfloat16")
    m = int(np.prod(lead, dtype=np.int64))
    if residual is not None and tuple(np.shape(residual)) != (*lead, n):
        raise ValueError(f"residual.shape={np.shape(residual)}, expected {(*lead, n)}")
    stacked_norm = False
    if prologue == "rmsnorm":
        if norm is None:
            raise ValueError("prologue='rmsnorm' needs norm= (the norm weight)")
        stacked_norm = np.ndim(norm) == 2
        want = (*w.stack, k) if stacked_norm else (k,)
        if tuple(np.shape(norm)) != want:
            raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k,)} or {(*w.stack, k)}")
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004
    if m == 0:
        return jnp.zeros((*lead, n), jnp.bfloat16)
    scale = params.get("input_scale")
    # a stacked [L] static scale goes to the kernel whole, read at the layer there: a slice of
    # it would be a launch of its own in front of every linear
    stacked_scale = scale is not None and np.ndim(scale) == 1 and layer is not None
    fused = nvfp4_gemv.Fused(
        prologue=prologue,
        residual=residual is not None,
        dynamic=scale is None,
        eps=float(eps),
        norm_stacked=stacked_norm,
        scale_stacked=stacked_scale,
    )
    if impl == "cuda":
        ok, why = nvfp4_gemv.check_shape("w4a4x", m, n, k) if kernels == "one" else (False, "")
        if not ok:  # the two-step lowering: what counts is the linear M picks (GEMV or GEMM)
            ok, why = _supported("w4a4", m, n, k, jnp.bfloat16, gemm_options, w.per_row)[1]
        if not ok:
            raise ValueError(f"fused_linear(impl='cuda'): {why}")
    spec, stacks = _prefetch_spec(prefetch, prefetch_options, layer)
    one = jnp.zeros((1,), jnp.bfloat16)
    args = (
        jnp.reshape(x, (m, width)),
        jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (-1,)),
        one if norm is None else jnp.asarray(norm, jnp.bfloat16),
        jnp.zeros((1, 1), jnp.bfloat16) if residual is None else jnp.reshape(residual, (m, n)),
        w.packed,
        jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
        jnp.asarray(w.global_scale, jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
        *stacks,
    )
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    y = _fused_p.bind(
        *args,
        n=n,
        k=k,
        fused=fused,
        impl=impl,
        launch=launch,
        gw_rows=w.per_row,
        options=options,
        kernels=kernels,
        gemm_options=gemm_options,
        residual_epilogue=bool(residual_epilogue),
        prefetch=spec,
    )
    return jnp.reshape(y, (*lead, n))


def takes_codes(m: int, params: dict, gemm_options=nvfp4_gemm.DEFAULT_OPTIONS) -> bool:
    """Whether `linear_from_codes` on M rows runs the plain W4A4 GEMV (M below
    `gemm_options.min_m`, a shape the GEMV takes): where a producer that writes the codes (the
    decode attention's NVFP4 output) saves the quantizer launch. From `min_m` on the GEMM reads
    x_hat, which XLA would build from the codes: not a saving."""
    w = params.get("weight")
    if not isinstance(w, Nvfp4Tensor):
        return False
    n, k = w.shape
    kind, (ok, _) = _supported("w4a4", m, n, k, jnp.bfloat16, gemm_options, w.per_row)
    return kind == "gemv" and ok


def _w4a4_weight(op: str, params: dict, layer) -> Nvfp4Tensor:
    """The weight of W4A4 `params` for `op`, checked: fusable, and stacked exactly when a layer
    is given."""
    if not fusable(params, "nvfp4"):
        raise ValueError(
            f"{op} needs W4A4 NVFP4 params without a bias (see fusable); got keys {sorted(params)}"
        )
    w: Nvfp4Tensor = params["weight"]
    _check_stack(w, layer)
    return w


def _check_stack(w: Nvfp4Tensor, layer) -> None:
    if len(w.stack) > 1 or (w.stack and layer is None) or (not w.stack and layer is not None):
        raise ValueError(f"w stack {w.stack} with layer={layer!r}: pass layer= for a stack only")


def _check_codes(xp, xs, xg, k: int) -> int:
    """M of an NVFP4 input (codes [M, K/2], E4M3 scales [M, K/16], global scale [M]); raises
    naming the operand that does not fit."""
    m = np.shape(xp)[0] if np.ndim(xp) == 2 else -1
    want = {"xp": ((m, k // 2), np.uint8), "xs": ((m, k // 16), np.uint8), "xg": ((m,), np.float32)}
    for name, a in (("xp", xp), ("xs", xs), ("xg", xg)):
        shape, dtype = want[name]
        if tuple(np.shape(a)) != shape or np.dtype(a.dtype) != np.dtype(dtype):
            raise ValueError(
                f"{name} {tuple(np.shape(a))} {np.dtype(a.dtype)}, expected {shape} "
                f"{np.dtype(dtype).name} (K={k})"
            )
    return m


def _check_static_scale(name: str, value, w: Nvfp4Tensor) -> tuple:
    """The shape of a static input scale `name` for the next linear: [] or [L] (w's stack), its
    values finite and > 0 where known at trace time."""
    layers = w.stack[0] if w.stack else 1
    shape = tuple(np.shape(value))
    if shape not in ((), (layers,)) or (shape and not w.stack):
        raise ValueError(
            f"{name} shape {shape}: expected a scalar or one per layer [L]=({layers},)"
        )
    if not isinstance(value, jax.core.Tracer):
        v = np.asarray(value, np.float32)
        bad = v[~(np.isfinite(v) & (v > 0))]
        if bad.size:
            raise ValueError(f"{name}={float(bad.flat[0])}: expected finite and > 0")
    return shape


def linear_from_codes(
    xp: jax.Array,
    xs: jax.Array,
    xg: jax.Array,
    params: dict,
    *,
    layer: Any = None,
    residual: jax.Array | None = None,
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    residual_epilogue: bool = False,
    prefetch: tuple = (),
    prefetch_options: nvfp4_gemv.Prefetch | None = None,
) -> jax.Array:
    """y = [residual +] the W4A4 linear of an input already quantized: `fused_linear` with
    prologue "none" after the quantizer, for a producer that writes the codes itself
    (`rejax.ops.decode_attention.decode_attention_nvfp4`). The same bytes in, the same result
    as `fused_linear(x, params, residual=...)` of the x they quantize (the GEMV of the two-step
    lowering; its reference elsewhere).

    Args:
        xp, xs, xg: codes uint8 [M, K/2], E4M3 block scales uint8 [M, K/16], global scale
            float32 [M] (`quantize_activation`'s bytes).
        params, layer, residual, options, gemm_options, residual_epilogue, prefetch,
            prefetch_options: as `fused_linear` (W4A4 params; their input_scale is the producer's
            business and is not read here).

    Returns:
        bf16 [M, N].
    """
    w = _w4a4_weight("linear_from_codes", params, layer)
    n, k = w.shape
    m = _check_codes(xp, xs, xg, k)
    if residual is not None and (
        tuple(np.shape(residual)) != (m, n) or np.dtype(residual.dtype) != np.dtype(jnp.bfloat16)
    ):
        raise ValueError(
            f"residual {np.shape(residual)} {np.dtype(residual.dtype)}, expected ({m}, {n}) bf16"
        )
    spec, stacks = _prefetch_spec(prefetch, prefetch_options, layer)
    pf = None
    if spec is not None:
        pf = (spec, tuple(zip(stacks[0::2], stacks[1::2], strict=True)))
    wp = w.packed
    ws = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    wg = jnp.asarray(w.global_scale, jnp.float32)
    li = jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(())
    in_kernel = residual is not None and residual_epilogue
    y = gemv_call(
        (xp, xs, xg, wp, ws, wg, li),
        act="w4a4",
        n=n,
        k=k,
        impl="auto",
        launch=_dispatch.default_launch(),
        gw_rows=w.per_row,
        options=options,
        gemm_options=gemm_options,
        residual=residual if in_kernel else None,
        prefetch=pf,
    )
    return residual + y if residual is not None and not in_kernel else y


def _codes_avals(m: int, k: int) -> tuple:
    """Abstract values of an NVFP4 input of width K on M rows: codes, E4M3 scales, global
    scale."""
    return (
        jax.core.ShapedArray((m, k // 2), jnp.uint8),
        jax.core.ShapedArray((m, k // nvfp4.BLOCK), jnp.uint8),
        jax.core.ShapedArray((m,), jnp.float32),
    )


def _jitted_primitive(name: str, abstract_eval) -> Primitive:
    """A primitive with several results and `abstract_eval`, run through jit when called
    outside a traced function."""
    prim = Primitive(name)
    prim.multiple_results = True
    prim.def_abstract_eval(abstract_eval)
    jitted = functools.cache(lambda **params: jax.jit(functools.partial(prim.bind, **params)))
    prim.def_impl(lambda *args, **params: jitted(**params)(*args))
    return prim


# ------------------------------------------------------------------ o_proj writing gate_up's input


def norm_out_supported(
    m: int,
    n: int,
    k: int,
    gemm_options=nvfp4_gemm.DEFAULT_OPTIONS,
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """Whether the NORM_OUT GEMV (`linear_norm_out`'s kernel) takes a residual linear's problem
    on M rows: the plain W4A4 GEMV's rows (below `gemm_options.min_m`) and shape, and an N the
    quantizer kernel takes as its K (the "bf16" path's launch, whose bytes the tail repeats)."""
    if m >= gemm_options.min_m:
        return False, f"M={m} rows take the GEMM (gemm_options.min_m={gemm_options.min_m})"
    ok, why = nvfp4_gemv.check_shape("w4a4", m, n, k)
    if not ok:
        return False, why
    ok, why = nvfp4_quant.check_shape(m, n)
    return ok, "" if ok else f"the next linear's input N={n}: {why}"


def _norm_out_composed(xp, xs, xg, res, wp, ws, wg, layer, nw, xgn, *, n, k, gw_rows, out, bind,
                       quant):  # fmt: skip
    """y = res + the W4A4 GEMV (in its epilogue on CUDA), then the quantizer with prologue
    "rmsnorm" on y: its kernel (`quant`) where it builds, else XLA's ops."""
    y = gemv_call((xp, xs, xg, wp, ws, wg, layer), act="w4a4", n=n, k=k, gw_rows=gw_rows,
                  residual=res, **bind)  # fmt: skip
    return (y, *_quant_p.bind(y, xgn, nw, layer, k=n, fused=out, kernel=quant))


_norm_out_p = _jitted_primitive(
    "rejax_nvfp4_linear_norm_out",
    lambda xp, *_, n, **__: (
        jax.core.ShapedArray((xp.shape[0], n), jnp.bfloat16),
        *_codes_avals(xp.shape[0], n),
    ),
)


def _norm_out_bind(impl, launch, options, gemm_options) -> dict:
    return {"impl": impl, "launch": launch, "options": options, "gemm_options": gemm_options}


def _lower_norm_out_reference(ctx, *args, n, k, gw_rows, out, impl, launch, options,
                              gemm_options):  # fmt: skip
    _dispatch.refuse_off_cuda(OP, impl, ctx.module_context.platforms)
    bind = _norm_out_bind(impl, launch, options, gemm_options)
    fn = functools.partial(_norm_out_composed, n=n, k=k, gw_rows=gw_rows, out=out, bind=bind,
                           quant=None)  # fmt: skip
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


@functools.cache
def _note_norm_out_two_steps(why: str) -> None:
    """Logs once per reason that the next linear's codes take a quantizer launch of their own."""
    _LOG.warning("%s: the next linear's codes take a quantizer launch: %s", OP, why)


def _lower_norm_out_cuda(ctx, *args, n, k, gw_rows, out, impl, launch, options, gemm_options):
    m = ctx.avals_in[0].shape[0]
    ok, why = norm_out_supported(m, n, k, gemm_options, options)
    if ok and launch != "ptx":
        ok, why = False, f"launch={launch!r} (the NORM_OUT epilogue needs the PTX custom call)"
    if ok and impl != "ref":
        chunk = nvfp4_quant.default_chunk(n)
        norm_out = nvfp4_gemv.NormOut(norm_stacked=out.norm_stacked, scale_stacked=out.scale_stacked,
                                      eps=out.eps, threads=nvfp4_quant.default_threads(chunk))  # fmt: skip
        try:
            gemv = nvfp4_gemv.build("w4a4", m, n, k, options=options, gw_rows=gw_rows,
                                    residual=True, norm_out=norm_out)  # fmt: skip
        except nvfp4_gemv.KernelError as err:
            ok, why = False, f"kernel build failed: {err}"
        else:
            return _dispatch.lower_ptx(ctx, *args, backend_config=gemv.backend_config())
    if impl == "cuda":
        raise ValueError(f"linear_norm_out(impl='cuda') cannot run: {why}")
    if impl != "ref":
        _note_norm_out_two_steps(why)
    quant = None
    if impl != "ref" and nvfp4_quant.check_shape(m, n)[0] and m <= nvfp4_gemv.MAX_M:
        try:
            quant = nvfp4_quant.build(m, n, out)
        except nvfp4_gemv.KernelError:
            quant = None
    bind = _norm_out_bind(impl, launch, options, gemm_options)
    fn = functools.partial(_norm_out_composed, n=n, k=k, gw_rows=gw_rows, out=out, bind=bind,
                           quant=quant)  # fmt: skip
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(_norm_out_p, _lower_norm_out_reference)
mlir.register_lowering(_norm_out_p, _lower_norm_out_cuda, platform="cuda")


def linear_norm_out(
    xp: jax.Array,
    xs: jax.Array,
    xg: jax.Array,
    params: dict,
    *,
    residual: jax.Array,
    norm: jax.Array,
    next_scale: Any,
    layer: Any = None,
    eps: float = 1e-6,
    impl: str = "auto",
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array, jax.Array]]:
    """y = residual + the W4A4 linear of an input already quantized (`linear_from_codes` with
    the residual in the GEMV's epilogue), and the next linear's NVFP4 input: the codes, block
    scales and global scale of `quantize_activation(rms_norm(y, norm, eps), next_scale)`, as the
    quantizer with prologue "rmsnorm" gives them (o_proj, then gate_up's input). On CUDA at the
    plain GEMV's rows one launch writes both (`norm_out_supported`): the last CTA to finish
    reads y back and quantizes it with the quantizer kernel's arithmetic and summation order, so
    the bytes are that kernel's; elsewhere the GEMV then the quantizer (kernel or XLA's ops).

    Args:
        xp, xs, xg: the input's codes uint8 [M, K/2], E4M3 scales uint8 [M, K/16], global
            scale float32 [M].
        params: W4A4 params (`fusable`), N x K.
        residual: bf16 [M, N].
        norm: the next linear's RMSNorm weight, bf16 [N], or [L, N] read at `layer`.
        next_scale: the next linear's static input scale, float32 [] or [L] (read at `layer`),
            finite and > 0.
        layer, options, gemm_options: as `linear_from_codes`.
        eps: the RMSNorm epsilon.
        impl: "auto" (the kernel where it applies), "cuda" (the kernel or an error) or "ref"
            (the composition's reference ops).

    Returns:
        (y bf16 [M, N], (codes uint8 [M, N/2], scales uint8 [M, N/16], global scale f32 [M])).
    """
    _dispatch.check_impl(impl)
    w = _w4a4_weight("linear_norm_out", params, layer)
    n, k = w.shape
    m = _check_codes(xp, xs, xg, k)
    if tuple(np.shape(residual)) != (m, n) or np.dtype(residual.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(
            f"residual {np.shape(residual)} {np.dtype(residual.dtype)}, expected ({m}, {n}) bf16"
        )
    if n % nvfp4.BLOCK:
        raise ValueError(
            f"N={n} must be a multiple of {nvfp4.BLOCK} (NVFP4 blocks of the next input)"
        )
    layers = w.stack[0] if w.stack else 1
    stacked_norm = np.ndim(norm) == 2
    want_norm = (layers, n) if stacked_norm else (n,)
    if tuple(np.shape(norm)) != want_norm or (stacked_norm and not w.stack):
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(n,)} or {(*w.stack, n)}")
    sshape = _check_static_scale("next_scale", next_scale, w)
    out = nvfp4_gemv.Fused(prologue="rmsnorm", eps=float(eps), norm_stacked=stacked_norm,
                           scale_stacked=len(sshape) == 1)  # fmt: skip
    if m == 0:
        return residual, (jnp.zeros((0, n // 2), jnp.uint8), jnp.zeros((0, n // 16), jnp.uint8),
                          jnp.zeros((0,), jnp.float32))  # fmt: skip
    args = (
        xp, xs, xg, residual, w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
        jnp.asarray(w.global_scale, jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
        jnp.asarray(norm, jnp.bfloat16), jnp.reshape(jnp.asarray(next_scale, jnp.float32), (-1,)),
    )  # fmt: skip
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    y, *q = _norm_out_p.bind(*args, n=n, k=k, gw_rows=w.per_row, out=out, impl=impl,
                             launch=launch, options=options, gemm_options=gemm_options)  # fmt: skip
    return y, tuple(q)


def _prefetch_spec(prefetch, options, layer) -> tuple[nvfp4_gemv.Prefetch | None, tuple]:
    """(the static `Prefetch` with its targets, their (codes, scales) operands) for
    `fused_linear`'s prefetch arguments; (None, ()) without `options`."""
    if options is None:
        if prefetch:
            raise ValueError("prefetch= targets need prefetch_options= (a nvfp4_gemv.Prefetch)")
        return None, ()
    if not isinstance(options, nvfp4_gemv.Prefetch):
        got = type(options).__name__
        raise ValueError(f"prefetch_options must be a nvfp4_gemv.Prefetch, got {got}")  # noqa: TRY004
    if prefetch and layer is None:
        raise ValueError("prefetch= targets are layer stacks: pass layer=")
    targets, stacks = [], []
    for entry in prefetch:
        if not (isinstance(entry, tuple) and len(entry) == 3):
            raise ValueError(f"prefetch entry {entry!r}: expected (Nvfp4Tensor, delta, fraction)")
        w, delta, fraction = entry
        if not isinstance(w, Nvfp4Tensor) or len(w.stack) != 1:
            raise ValueError("prefetch targets must be Nvfp4Tensor stacks [L, N, K/2]")
        n, k = w.shape
        targets.append(nvfp4_gemv.PrefetchTarget(n, k, w.stack[0], int(delta), float(fraction)))
        stacks += [w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8)]
    spec = dataclasses.replace(options, targets=tuple(targets))
    return spec, tuple(stacks)


# ----------------------------------------------------------------------------- SwiGLU codes
#
# fused_linear_swiglu: gate_up_proj whose output is down_proj's NVFP4 input. On CUDA, at the
# GEMV's rows (below gemm_options.min_m), the quantizer kernel (RMSNorm, gate_up's input), then
# the plain W4A4 GEMV built with its SwiGLU epilogue (cuda_ops/nvfp4_gemv.cu, SWIGLU_OUT): each
# CTA owns the gate and up rows of whole 16-element blocks of down's input and writes their
# codes, so neither the bf16 [M, 2F] gate_up output nor down's quantizer launch is left.
# Elsewhere the composition: fused_linear's gate_up (prologue "rmsnorm"), then the quantizer
# with prologue "swiglu" (its kernel where it builds, on CUDA).


def _swiglu_reference(x, xg, nw, wp, ws, wg, layer, xgd, *_pf, n, k, fused, down, **_: Any):
    """(codes, scales, global scale) of swiglu(gate_up(x)) with down's static scale."""
    one = jnp.zeros((1, 1), jnp.bfloat16)
    h = _reference(x, xg, nw, one, wp, ws, wg, layer, n=n, k=k, fused=fused)
    return _quant_reference(h, xgd, jnp.zeros((1,), jnp.bfloat16), layer, k=n // 2, fused=down)


_swiglu_p = _jitted_primitive(
    "rejax_nvfp4_gate_up_swiglu", lambda x, *_, n, **__: _codes_avals(x.shape[0], n // 2)
)


def _lower_swiglu_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_swiglu_reference, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def swiglu_kernel_supported(
    m: int,
    n: int,
    k: int,
    gemm_options=nvfp4_gemm.DEFAULT_OPTIONS,
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """Whether the SwiGLU-epilogue GEMV takes gate_up_proj's problem on M rows: the plain W4A4
    GEMV's rows (below `gemm_options.min_m`, at most MAX_M) where that GEMV is the persistent
    kernel (not the streaming one of M <= 2 on small layers: the epilogue is the persistent
    kernel's, and so are its sums, in the same order), its K, and N = 2F with F a multiple of
    16 (whole blocks of down's input) that the quantizer kernel takes (the "bf16" path's
    launches, whose bytes the epilogue's equal)."""
    if m >= gemm_options.min_m:
        return False, f"M={m} rows take the GEMM (gemm_options.min_m={gemm_options.min_m})"
    if n % nvfp4_gemv.SWIGLU_UNIT:
        return False, f"N={n}: gate_up's 2F must be a multiple of {nvfp4_gemv.SWIGLU_UNIT}"
    ok, why = nvfp4_gemv.check_shape("w4a4", m, n, k)
    if not ok:
        return False, why
    if nvfp4_gemv.plan("w4a4", m, n, k, options=options).variant != "persistent":
        return False, (
            f"M={m} N={n} K={k}: the plain GEMV is the streaming kernel there (the SwiGLU "
            "epilogue is the persistent kernel's)"
        )
    ok, why = nvfp4_quant.check_shape(m, k)
    if not ok:
        return False, why
    # down's input: where the quantizer kernel does not take it, the "bf16" path quantizes with
    # XLA's ops, whose SwiGLU need not round as the epilogue does
    ok, why = nvfp4_quant.check_shape(m, n // 2)
    return ok, "" if ok else f"down's input F={n // 2}: {why}"


def _swiglu_kernels(x, xg, nw, wp, ws, wg, layer, xgd, *pf_stacks, n, k, fused, quant, gemv):
    """The quantizer kernel (gate_up's input), then the SwiGLU-epilogue GEMV on its codes."""
    pro = dataclasses.replace(fused, residual=False)
    xp, xs, xgr = _quant_p.bind(x, xg, nw, layer, k=k, fused=pro, kernel=quant)
    m = x.shape[0]
    out = (
        jax.ShapeDtypeStruct((m, n // 4), jnp.uint8),
        jax.ShapeDtypeStruct((m, n // 32), jnp.uint8),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    ops = (xp, xs, xgr, wp, ws, wg, layer, *pf_stacks, xgd)
    return tuple(_dispatch.ptx_call(gemv.backend_config(), out, *ops))


@functools.cache
def _note_swiglu_two_steps(why: str) -> None:
    """Logs once per reason that gate_up's SwiGLU codes run as fused_linear then the quantizer
    (the launches of the "bf16" path), not the SwiGLU-epilogue GEMV: not a reference path."""
    _LOG.warning("%s: gate_up's SwiGLU codes take two steps: %s", OP, why)


def _swiglu_composed(x, xg, nw, wp, ws, wg, layer, xgd, *pf_stacks, n, k, fused, down, bind):
    """Where the kernel does not serve: gate_up as fused_linear lowers it (`bind`: its params),
    then the quantizer with prologue "swiglu" (its kernel where it builds, else XLA's ops)."""
    m = x.shape[0]
    res = jnp.zeros((1, 1), jnp.bfloat16)
    h = _fused_p.bind(x, xg, nw, res, wp, ws, wg, layer, *pf_stacks, n=n, k=k, fused=fused, **bind)
    quant = None
    if nvfp4_quant.check_shape(m, n // 2)[0] and m <= nvfp4_gemv.MAX_M:
        try:
            quant = nvfp4_quant.build(m, n // 2, down)
        except nvfp4_gemv.KernelError:
            quant = None
    nw = jnp.zeros((1,), jnp.bfloat16)
    return tuple(_quant_p.bind(h, xgd, nw, layer, k=n // 2, fused=down, kernel=quant))


def _lower_swiglu_cuda(ctx, *args, n, k, fused, down, impl, launch, options, gemm_options,
                       gw_rows, prefetch):  # fmt: skip
    m = ctx.avals_in[0].shape[0]
    ok, why = swiglu_kernel_supported(m, n, k, gemm_options, options)
    if ok and launch != "ptx":
        ok, why = False, f"launch={launch!r} (the SwiGLU epilogue needs the PTX custom call)"
    quant = gemv = None
    if ok and impl != "ref":
        try:
            quant = nvfp4_quant.build(m, k, dataclasses.replace(fused, residual=False))
            gemv = nvfp4_gemv.build(
                "w4a4", m, n, k, options=options, gw_rows=gw_rows, prefetch=prefetch,
                swiglu_out="stacked" if down.scale_stacked else "scalar",
            )  # fmt: skip
        except nvfp4_gemv.KernelError as err:
            ok, why = False, f"kernel build failed: {err}"
    if ok and gemv is not None:
        fn = functools.partial(_swiglu_kernels, n=n, k=k, fused=fused, quant=quant, gemv=gemv)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    if impl == "cuda":
        raise ValueError(f"fused_linear_swiglu(impl='cuda') cannot run: {why}")
    if impl == "ref":
        fn = functools.partial(_swiglu_reference, n=n, k=k, fused=fused, down=down)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    _note_swiglu_two_steps(why)
    bind = {
        "impl": impl, "launch": launch, "gw_rows": gw_rows, "options": options, "kernels": "two",
        "gemm_options": gemm_options, "residual_epilogue": False, "prefetch": prefetch,
    }  # fmt: skip
    fn = functools.partial(_swiglu_composed, n=n, k=k, fused=fused, down=down, bind=bind)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(_swiglu_p, _lower_swiglu_reference)
mlir.register_lowering(_swiglu_p, _lower_swiglu_cuda, platform="cuda")


def fused_linear_swiglu(
    x: jax.Array,
    params: dict,
    down_scale: Any,
    *,
    layer: Any = None,
    norm: jax.Array,
    eps: float = 1e-6,
    impl: str = "auto",
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    prefetch: tuple = (),
    prefetch_options: nvfp4_gemv.Prefetch | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """gate_up_proj with the RMSNorm prologue, returning down_proj's NVFP4 input: the codes,
    block scales and global scale of `quantize_activation(swiglu(gate, up), down_scale)`, as
    `fused_linear(x, params, prologue="rmsnorm", norm=norm, kernels="two")` then the quantizer
    with prologue "swiglu" give them (the bytes `linear_from_codes` takes for down_proj). On
    CUDA at the GEMV's rows the GEMV's SwiGLU epilogue writes them (one launch fewer, no bf16
    gate_up output; the same device arithmetic as the quantizer kernel's, so the same bytes).

    Args:
        x: [M, K] bf16, the residual stream.
        params: gate_up_proj's W4A4 params (`fusable`), N = 2F rows: gate first, then up.
        down_scale: down_proj's static input scale, float32 [] or [L] (read at `layer`), > 0.
        layer, norm, eps, impl, options, gemm_options, prefetch, prefetch_options: as
            `fused_linear` ("rmsnorm" prologue).

    Returns:
        (codes uint8 [M, F/2], E4M3 scales uint8 [M, F/16], global scale float32 [M]).
    """
    _dispatch.check_impl(impl)
    w = _w4a4_weight("fused_linear_swiglu", params, layer)
    n, k = w.shape
    if n % 32:
        raise ValueError(f"gate_up N={n} must be 2F with F a multiple of 16 (NVFP4 blocks)")
    if np.ndim(x) != 2 or np.shape(x)[1] != k or np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"x {np.shape(x)} {np.dtype(x.dtype)}, expected [M, {k}] bfloat16")
    stacked_norm = np.ndim(norm) == 2
    want = (*w.stack, k) if stacked_norm else (k,)
    if tuple(np.shape(norm)) != want:
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k,)} or {(*w.stack, k)}")
    dshape = _check_static_scale("down_scale", down_scale, w)
    scale = params.get("input_scale")
    fused = nvfp4_gemv.Fused(
        prologue="rmsnorm",
        dynamic=scale is None,
        eps=float(eps),
        norm_stacked=stacked_norm,
        scale_stacked=scale is not None and np.ndim(scale) == 1 and layer is not None,
    )
    down = nvfp4_gemv.Fused(prologue="swiglu", scale_stacked=len(dshape) == 1)
    spec, stacks = _prefetch_spec(prefetch, prefetch_options, layer)
    m = np.shape(x)[0]
    if m == 0:
        return (jnp.zeros((0, n // 4), jnp.uint8), jnp.zeros((0, n // 32), jnp.uint8),
                jnp.zeros((0,), jnp.float32))  # fmt: skip
    args = (
        x,
        jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (-1,)),
        jnp.asarray(norm, jnp.bfloat16),
        w.packed,
        jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
        jnp.asarray(w.global_scale, jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
        jnp.reshape(jnp.asarray(down_scale, jnp.float32), (-1,)),
        *stacks,
    )
    bind = {
        "n": n, "k": k, "fused": fused, "down": down, "impl": impl, "options": options,
        "gemm_options": gemm_options, "gw_rows": w.per_row, "prefetch": spec,
        "launch": _dispatch.default_launch() if impl != "ref" else "ptx",
    }  # fmt: skip
    return tuple(_swiglu_p.bind(*args, **bind))


# ------------------------------------------------------------------ gate_up on given codes


def _swiglu_codes_composed(xp, xs, xg, wp, ws, wg, layer, xgd, *, n, k, gw_rows, down, bind,
                           quant):  # fmt: skip
    """gate_up's plain W4A4 GEMV on the codes (bf16 [gate | up]), then the quantizer with
    prologue "swiglu" and down's static scale: its kernel (`quant`) where it builds, else
    XLA's ops."""
    h = gemv_call((xp, xs, xg, wp, ws, wg, layer), act="w4a4", n=n, k=k, gw_rows=gw_rows, **bind)
    nw = jnp.zeros((1,), jnp.bfloat16)
    return tuple(_quant_p.bind(h, xgd, nw, layer, k=n // 2, fused=down, kernel=quant))


_swiglu_codes_p = _jitted_primitive(
    "rejax_nvfp4_gate_up_swiglu_codes", lambda xp, *_, n, **__: _codes_avals(xp.shape[0], n // 2)
)


def _lower_swiglu_codes_reference(ctx, *args, n, k, gw_rows, down, impl, launch, options,
                                  gemm_options):  # fmt: skip
    _dispatch.refuse_off_cuda(OP, impl, ctx.module_context.platforms)
    bind = _norm_out_bind(impl, launch, options, gemm_options)
    fn = functools.partial(_swiglu_codes_composed, n=n, k=k, gw_rows=gw_rows, down=down,
                           bind=bind, quant=None)  # fmt: skip
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _lower_swiglu_codes_cuda(ctx, *args, n, k, gw_rows, down, impl, launch, options,
                             gemm_options):  # fmt: skip
    m = ctx.avals_in[0].shape[0]
    ok, why = swiglu_kernel_supported(m, n, k, gemm_options, options)
    if ok and launch != "ptx":
        ok, why = False, f"launch={launch!r} (the SwiGLU epilogue needs the PTX custom call)"
    if ok and impl != "ref":
        try:
            gemv = nvfp4_gemv.build("w4a4", m, n, k, options=options, gw_rows=gw_rows,
                                    swiglu_out="stacked" if down.scale_stacked else "scalar")  # fmt: skip
        except nvfp4_gemv.KernelError as err:
            ok, why = False, f"kernel build failed: {err}"
        else:
            return _dispatch.lower_ptx(ctx, *args, backend_config=gemv.backend_config())
    if impl == "cuda":
        raise ValueError(f"linear_swiglu_from_codes(impl='cuda') cannot run: {why}")
    if impl != "ref":
        _note_swiglu_two_steps(why)
    quant = None
    if impl != "ref" and nvfp4_quant.check_shape(m, n // 2)[0] and m <= nvfp4_gemv.MAX_M:
        try:
            quant = nvfp4_quant.build(m, n // 2, down)
        except nvfp4_gemv.KernelError:
            quant = None
    bind = _norm_out_bind(impl, launch, options, gemm_options)
    fn = functools.partial(_swiglu_codes_composed, n=n, k=k, gw_rows=gw_rows, down=down,
                           bind=bind, quant=quant)  # fmt: skip
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(_swiglu_codes_p, _lower_swiglu_codes_reference)
mlir.register_lowering(_swiglu_codes_p, _lower_swiglu_codes_cuda, platform="cuda")


def linear_swiglu_from_codes(
    xp: jax.Array,
    xs: jax.Array,
    xg: jax.Array,
    params: dict,
    down_scale: Any,
    *,
    layer: Any = None,
    impl: str = "auto",
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """`fused_linear_swiglu` on an input already quantized (gate_up after `linear_norm_out`):
    down_proj's NVFP4 input, the codes, block scales and global scale of
    `quantize_activation(swiglu(gate, up), down_scale)` of the plain W4A4 linear of the given
    codes. On CUDA where `swiglu_kernel_supported` the GEMV's SwiGLU epilogue writes them (one
    launch); elsewhere the GEMV then the quantizer with prologue "swiglu" (kernel or XLA's ops).

    Args:
        xp, xs, xg: gate_up's input, codes uint8 [M, K/2], E4M3 scales uint8 [M, K/16], global
            scale float32 [M].
        params: gate_up_proj's W4A4 params (`fusable`), N = 2F rows: gate first, then up.
        down_scale: down_proj's static input scale, float32 [] or [L] (read at `layer`), > 0.
        layer, impl, options, gemm_options: as `linear_norm_out`.

    Returns:
        (codes uint8 [M, F/2], E4M3 scales uint8 [M, F/16], global scale float32 [M]).
    """
    _dispatch.check_impl(impl)
    w = _w4a4_weight("linear_swiglu_from_codes", params, layer)
    n, k = w.shape
    if n % 32:
        raise ValueError(f"gate_up N={n} must be 2F with F a multiple of 16 (NVFP4 blocks)")
    m = _check_codes(xp, xs, xg, k)
    dshape = _check_static_scale("down_scale", down_scale, w)
    down = nvfp4_gemv.Fused(prologue="swiglu", scale_stacked=len(dshape) == 1)
    if m == 0:
        return (jnp.zeros((0, n // 4), jnp.uint8), jnp.zeros((0, n // 32), jnp.uint8),
                jnp.zeros((0,), jnp.float32))  # fmt: skip
    args = (
        xp, xs, xg, w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
        jnp.asarray(w.global_scale, jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
        jnp.reshape(jnp.asarray(down_scale, jnp.float32), (-1,)),
    )  # fmt: skip
    launch = _dispatch.default_launch() if impl != "ref" else "ptx"
    return tuple(_swiglu_codes_p.bind(*args, n=n, k=k, gw_rows=w.per_row, down=down, impl=impl,
                                      launch=launch, options=options,
                                      gemm_options=gemm_options))  # fmt: skip
