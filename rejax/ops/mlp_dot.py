"""The feed-forward half on the dot path as one op: x + down(swiglu(gate_up(rms_norm(x)))).

Above `GemmOptions.max_m` rows (prefill) each W4A4 linear runs as one bf16 dot on exact values
(`rejax.ops.fused_linear`'s dot path: the quantizer kernel's "xhat_bf16" form writes the
activations' values, the dequantizer kernel the weight's). There gate_up's dot leaves a float32
sum [M, 2F] that XLA scales by the global scales and rounds to bf16 (one fusion reading 4 bytes
and writing 2 a value), and down's SwiGLU quantizer then reads that bf16 gate_up output again.
`mlp_dot` lets down's quantizer read the float32 sum itself: the finish-quantizer entry in its
"xhat_bf16" form with `FinishIn.dot` (cuda_ops/nvfp4_quant.py) forms each gate_up value as
`rejax.nvfp4.scale_x_values_sum` does (the same float32 products, the same rounding), then runs
the SwiGLU quantizer on those values. So on CUDA the op is bitwise the two fused linears' dot
path; one fusion and the bf16 gate_up round trip go.

Its reference is the composition `fused_linear(x, gate_up, prologue="rmsnorm")` then
`fused_linear(h, down, prologue="swiglu", residual=x)`: the same primitive bound twice, so off
CUDA (and on CUDA where `mlp_dot_supported` says no) the op lowers exactly as those two calls.
The decoder takes it under `Config.gate_up_dot_out` "float32".
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

from cuda_ops import nvfp4_dequant, nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl
from rejax.ops.linear import dequant_call, dot_with_values, prefers_dot, takes_wgmma

OP = "nvfp4_mlp_dot"
_LOG = logging.getLogger("rejax.ops")


def mlp_dot_supported(
    m: int,
    gate_up_shape: tuple[int, int],
    down_shape: tuple[int, int],
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """(True, "") where `mlp_dot`'s kernels serve M rows of gate_up [2F, D] and down [D, F]: the
    dot path (M above `gemm_options.max_m`, outside the wgmma range) with the dequantizer
    kernel (`dot_dequant` "kernel") and the quantizer's values (`dot_x` "kernel"), and shapes
    the quantizer kernel takes; else (False, why)."""
    (n_g, k_g), (n_d, k_d) = gate_up_shape, down_shape
    if n_g != 2 * k_d or n_d != k_g:
        return False, f"gate_up {gate_up_shape} and down {down_shape}: expected [2F, D] and [D, F]"
    if takes_wgmma("w4a4", m, "auto", gemm_options) or not prefers_dot(
        "w4a4", m, "auto", gemm_options
    ):
        return False, f"M={m} rows are not the dot path (gemm_options.max_m={gemm_options.max_m})"
    if gemm_options.dot_dequant != "kernel" or gemm_options.dot_x != "kernel":
        return False, (
            f"dot_dequant={gemm_options.dot_dequant!r}, dot_x={gemm_options.dot_x!r} "
            "(the kernels' values need both 'kernel')"
        )
    for k in (k_g, k_d):
        ok, why = nvfp4_quant.check_shape(m, k)
        if not ok:
            return False, why
    return True, ""


# ----------------------------------------------------------------------------- primitive

_mlp_dot_p = Primitive("rejax_nvfp4_mlp_dot")
_mlp_dot_p.def_abstract_eval(lambda x, *_, **__: jax.core.ShapedArray(x.shape, jnp.bfloat16))


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_mlp_dot_p.bind, **params))


_mlp_dot_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _composed(x, xg_g, nw, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer, *, shapes, fused,
              gw_rows, bind):  # fmt: skip
    """The two fused linears as `fused_linear` binds them (`bind`: their shared params as
    (name, value) pairs)."""
    (n_g, k_g), (n_d, k_d) = shapes
    bind = dict(bind)
    no_res = jnp.zeros((1, 1), jnp.bfloat16)
    h = fl._fused_p.bind(x, xg_g, nw, no_res, wp_g, ws_g, wg_g, layer, n=n_g, k=k_g,
                         fused=fused[0], gw_rows=gw_rows[0], prefetch=None, **bind)  # fmt: skip
    one = jnp.zeros((1,), jnp.bfloat16)
    return fl._fused_p.bind(h, xg_d, one, x, wp_d, ws_d, wg_d, layer, n=n_d, k=k_d,
                            fused=fused[1], gw_rows=gw_rows[1], prefetch=None, **bind)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Plan:
    quant: Any  # gate_up's quantizer, "xhat_bf16" form
    dq_g: Any  # the dequantizer kernels of gate_up and down
    dq_d: Any
    fin: Any  # down's SwiGLU quantizer on gate_up's float32 sum ("xhat_bf16", FinishIn.dot)


def _build(m: int, shapes, fused, gw_rows) -> _Plan:
    (n_g, k_g), (n_d, k_d) = shapes
    pro_g, pro_d = (dataclasses.replace(f, residual=False) for f in fused)
    finish = nvfp4_quant.FinishIn.dot(gw_rows[0])
    return _Plan(
        quant=nvfp4_quant.build(m, k_g, pro_g, out="xhat_bf16"),
        dq_g=nvfp4_dequant.build(n_g, k_g),
        dq_d=nvfp4_dequant.build(n_d, k_d),
        fin=nvfp4_quant.build(m, k_d, pro_d, out="xhat_bf16", finish=finish),
    )


def _kernels(x, xg_g, nw, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer, *, shapes, fused,
             plan: _Plan):  # fmt: skip
    """gate_up's values and float32 sum, down's SwiGLU quantizer on that sum, down's dot, + x."""
    (_, k_g), (_, k_d) = shapes
    m = x.shape[0]
    pro_g = dataclasses.replace(fused[0], residual=False)
    xv, xgr = fl._quant_xbf16_p.bind(x, xg_g, nw, layer, k=k_g, fused=pro_g, kernel=plan.quant)
    acc = nvfp4.x_values_sum(xv, dequant_call(wp_g, ws_g, layer, kernel=plan.dq_g))
    outs = (
        jax.ShapeDtypeStruct((1,), jnp.bfloat16),  # y: not stored (FinishIn.store_y off)
        jax.ShapeDtypeStruct((m, k_d), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    dummy = jnp.zeros((1,), jnp.bfloat16)  # no residual in the finish; SwiGLU has no norm
    _, hv, hg = _dispatch.ptx_call(plan.fin.backend_config(), outs, acc, xgr, dummy, wg_g, xg_d,
                                   dummy, layer)  # fmt: skip
    return x + dot_with_values(hv, hg, wp_d, ws_d, wg_d, layer, kernel=plan.dq_d)


def _lower_reference(ctx, *args, shapes, fused, gw_rows, bind):
    _dispatch.refuse_off_cuda(OP, dict(bind)["impl"], ctx.module_context.platforms)
    fn = functools.partial(_composed, shapes=shapes, fused=fused, gw_rows=gw_rows, bind=bind)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


@functools.cache
def _note_composed(why: str) -> None:
    """Logs once per reason that the op runs as its two fused linears (their own CUDA
    lowering, not a reference path)."""
    _LOG.warning("%s: gate_up and down run as two fused linears: %s", OP, why)


def _lower_cuda(ctx, *args, shapes, fused, gw_rows, bind):
    m = ctx.avals_in[0].shape[0]
    params = dict(bind)
    ok, why = mlp_dot_supported(m, *shapes, params["gemm_options"])
    if ok and params["launch"] != "ptx":
        ok, why = False, f"launch={params['launch']!r} (the kernels need the PTX custom call)"
    plan = None
    if ok and params["impl"] != "ref":
        try:
            plan = _build(m, shapes, fused, gw_rows)
        except nvfp4_gemv.KernelError as err:
            ok, why = False, f"kernel build failed: {err}"
            _note_composed(why)
    if plan is not None:
        fn = functools.partial(_kernels, shapes=shapes, fused=fused, plan=plan)
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    if params["impl"] == "cuda" and not ok:
        raise ValueError(f"mlp_dot(impl='cuda') cannot run: {why}")
    fn = functools.partial(_composed, shapes=shapes, fused=fused, gw_rows=gw_rows, bind=bind)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


mlir.register_lowering(_mlp_dot_p, _lower_reference)
mlir.register_lowering(_mlp_dot_p, _lower_cuda, platform="cuda")


# ----------------------------------------------------------------------------- API


def mlp_dot(
    x: jax.Array,
    gate_up: dict,
    down: dict,
    *,
    layer: Any = None,
    norm: jax.Array,
    eps: float = 1e-6,
    impl: str = "auto",
    options: nvfp4_gemv.GemvOptions = nvfp4_gemv.DEFAULT_OPTIONS,
    kernels: str = "two",
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    residual_epilogue: bool = False,
) -> jax.Array:
    """x + down(swiglu(gate_up(rms_norm(x, norm, eps)))) as one op: exactly
    `fused_linear(x, gate_up, prologue="rmsnorm", norm=norm, eps=eps)` then
    `fused_linear(h, down, prologue="swiglu", residual=x)` (with `impl`, `options`, `kernels`,
    `gemm_options`, `residual_epilogue` passed to both). On CUDA where `mlp_dot_supported`
    holds, down's quantizer kernel reads gate_up's float32 dot sum (no bf16 gate_up output; the
    same bytes as the two linears' dot path); elsewhere the two fused linears' own lowering.

    Args:
        x: [M, D] bf16, the residual stream.
        gate_up: gate_up_proj's W4A4 params (`rejax.ops.fused_linear.fusable`), [2F, D], gate
            rows first.
        down: down_proj's W4A4 params, [D, F].
        layer: int32 [] index into stacked params (may be traced); None for unstacked ones.
        norm: the RMSNorm weight [D] or a stack [L, D].
        eps, impl, options, kernels, gemm_options, residual_epilogue: as `fused_linear`.

    Returns:
        bf16 [M, D].
    """
    _dispatch.check_impl(impl)
    if kernels not in fl.KERNELS:
        raise ValueError(f"kernels={kernels!r}, expected one of {fl.KERNELS}")
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004
    w_g = fl._w4a4_weight("mlp_dot gate_up", gate_up, layer)
    w_d = fl._w4a4_weight("mlp_dot down", down, layer)
    (n_g, k_g), (n_d, k_d) = w_g.shape, w_d.shape
    if n_g != 2 * k_d or n_d != k_g:
        raise ValueError(f"gate_up {w_g.shape} and down {w_d.shape}: expected [2F, D] and [D, F]")
    if np.ndim(x) != 2 or np.shape(x)[1] != k_g or np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"x {np.shape(x)} {np.dtype(x.dtype)}, expected [M, {k_g}] bfloat16")
    stacked_norm = np.ndim(norm) == 2
    want = (*w_g.stack, k_g) if stacked_norm else (k_g,)
    if tuple(np.shape(norm)) != want:
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k_g,)} or {(*w_g.stack, k_g)}")
    if np.shape(x)[0] == 0:
        return jnp.zeros((0, k_g), jnp.bfloat16)

    def scale_of(params):
        scale = params.get("input_scale")
        stacked = scale is not None and np.ndim(scale) == 1 and layer is not None
        operand = jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (-1,))
        return operand, scale is None, stacked

    xg_g, dyn_g, st_g = scale_of(gate_up)
    xg_d, dyn_d, st_d = scale_of(down)
    fused = (
        nvfp4_gemv.Fused(prologue="rmsnorm", dynamic=dyn_g, eps=float(eps),
                         norm_stacked=stacked_norm, scale_stacked=st_g),
        nvfp4_gemv.Fused(prologue="swiglu", residual=True, dynamic=dyn_d, scale_stacked=st_d),
    )  # fmt: skip

    def weight(w):
        return (w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
                jnp.asarray(w.global_scale, jnp.float32))  # fmt: skip

    args = (
        x, xg_g, jnp.asarray(norm, jnp.bfloat16), *weight(w_g), xg_d, *weight(w_d),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
    )  # fmt: skip
    bind = (
        ("impl", impl), ("launch", _dispatch.default_launch() if impl != "ref" else "ptx"),
        ("options", options), ("kernels", kernels), ("gemm_options", gemm_options),
        ("residual_epilogue", bool(residual_epilogue)),
    )  # fmt: skip
    return _mlp_dot_p.bind(*args, shapes=((n_g, k_g), (n_d, k_d)), fused=fused,
                           gw_rows=(w_g.per_row, w_d.per_row), bind=bind)  # fmt: skip
