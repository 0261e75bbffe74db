"""The post-attention half on the dot path with each float32 dot sum read by the next quantizer.

Above `GemmOptions.max_m` rows outside the wgmma range (prefill at batch 8: 4096 rows) each W4A4
linear runs as one bf16 dot on exact values (`rejax.ops.fused_linear`'s dot path: the quantizer
kernel's "xhat_bf16" form writes the activations' values, the dequantizer kernel the weight's).
The dot leaves a float32 sum that XLA scales by the global scales and rounds to bf16 (adding the
residual where there is one): one fusion reading 4 bytes and writing 2 a value, whose output the
next linear's quantizer kernel then reads again. Here the next quantizer reads the float32 sum
itself: the finish-quantizer entry (cuda_ops/nvfp4_quant.py) in its "xhat_bf16" form with
`FinishIn.dot` forms each value as `rejax.nvfp4.scale_x_values_sum` does (the same float32
products, the same rounding; with the residual, the same bf16 add) and quantizes it with the
quantizer kernel's device code and thread count, so the bytes are the two-step path's:

* `mlp_dot(x, gate_up, down)`: x + down(swiglu(gate_up(rms_norm(x)))), down's SwiGLU quantizer
  on gate_up's sum (the fusion over [M, 2F] goes);
* `post_attention_dot(out, x, o_proj, gate_up, down)`: h = x + o_proj(out), then `mlp_dot(h)`,
  with gate_up's RMSNorm quantizer on o_proj's sum plus the residual x (one CTA a row from 264
  rows keeps the row in shared memory and also stores h for the last residual add).

Each op's reference is the fused linears it replaces (the same primitive bound two or three
times), so off CUDA, and on rows the kernels do not serve, it lowers exactly as they do. The
decoder takes them under `Config.gemm_dot_finish` ("swiglu": `mlp_dot`; "block":
`post_attention_dot`).
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

OP = "nvfp4_dot_block"
_LOG = logging.getLogger("rejax.ops")
LINEARS = ("o_proj", "gate_up_proj", "down_proj")


def dot_block_supported(
    m: int,
    shapes: tuple,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """(True, "") where the ops' kernels serve M rows of the linears of `shapes`: ((n, k) of
    gate_up [2F, D] and down [D, F]) for `mlp_dot`, with o_proj's [D, K] first for
    `post_attention_dot`. That is the dot path (M above `gemm_options.max_m`, outside the wgmma
    range) with the dequantizer kernel (`dot_dequant` "kernel") and the quantizer's values
    (`dot_x` "kernel"), and inputs the quantizer kernel takes; else (False, why)."""
    *o, (n_g, k_g), (n_d, k_d) = shapes
    if n_g != 2 * k_d or n_d != k_g or (o and o[0][0] != k_g):
        want = "[D, K], [2F, D] and [D, F]" if o else "[2F, D] and [D, F]"
        return False, f"linear shapes {tuple(shapes)}: expected {want}"
    if takes_wgmma("w4a4", m, "auto", gemm_options) or not prefers_dot(
        "w4a4", m, "auto", gemm_options
    ):
        return False, f"M={m} rows are not the dot path (gemm_options.max_m={gemm_options.max_m})"
    if gemm_options.dot_dequant != "kernel" or gemm_options.dot_x != "kernel":
        return False, (
            f"dot_dequant={gemm_options.dot_dequant!r}, dot_x={gemm_options.dot_x!r} "
            "(the kernels' values need both 'kernel')"
        )
    for _, k in shapes:
        ok, why = nvfp4_quant.check_shape(m, k)
        if not ok:
            return False, why
    return True, ""


def mlp_dot_supported(m, gate_up_shape, down_shape, gemm_options=nvfp4_gemm.DEFAULT_OPTIONS):
    """`dot_block_supported` for `mlp_dot` (gate_up and down alone)."""
    return dot_block_supported(m, (tuple(gate_up_shape), tuple(down_shape)), gemm_options)


# ----------------------------------------------------------------------------- primitive
# operands: [out, x, xg_o, wp_o, ws_o, wg_o] (post_attention_dot) or [x] (mlp_dot), then
# xg_g, nw, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer. Params: shapes, fused and gw_rows
# per linear (3 or 2), bind: the fused linears' shared params as (name, value) pairs.

_dot_block_p = Primitive("rejax_nvfp4_dot_block")


def _abstract(*args, shapes, **_):
    x = args[1] if len(shapes) == 3 else args[0]  # post_attention_dot: (out, x, ...)
    return jax.core.ShapedArray(x.shape, jnp.bfloat16)


_dot_block_p.def_abstract_eval(_abstract)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_dot_block_p.bind, **params))


_dot_block_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _split(args, shapes):
    """(o_proj's operands (out, xg_o, wp_o, ws_o, wg_o) or None, x, the mlp's operands)."""
    if len(shapes) == 3:
        out, x, xg_o, wp_o, ws_o, wg_o, *rest = args
        return (out, xg_o, wp_o, ws_o, wg_o), x, rest
    x, *rest = args
    return None, x, rest


def _composed(*args, shapes, fused, gw_rows, bind):
    """The fused linears as `fused_linear` binds them."""
    bind = dict(bind)
    o, x, (xg_g, nw, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer) = _split(args, shapes)
    *_, (n_g, k_g), (n_d, k_d) = shapes
    one = jnp.zeros((1,), jnp.bfloat16)
    no_res = jnp.zeros((1, 1), jnp.bfloat16)
    if o is not None:
        out, xg_o, wp_o, ws_o, wg_o = o
        x = fl._fused_p.bind(out, xg_o, one, x, wp_o, ws_o, wg_o, layer, n=shapes[0][0],
                             k=shapes[0][1], fused=fused[0], gw_rows=gw_rows[0], prefetch=None,
                             **bind)  # fmt: skip
    h = fl._fused_p.bind(x, xg_g, nw, no_res, wp_g, ws_g, wg_g, layer, n=n_g, k=k_g,
                         fused=fused[-2], gw_rows=gw_rows[-2], prefetch=None, **bind)  # fmt: skip
    return fl._fused_p.bind(h, xg_d, one, x, wp_d, ws_d, wg_d, layer, n=n_d, k=k_d,
                            fused=fused[-1], gw_rows=gw_rows[-1], prefetch=None, **bind)  # fmt: skip


@dataclasses.dataclass(frozen=True)
class _Plan:
    quant: Any  # the first linear's quantizer, "xhat_bf16" form
    dq: tuple  # the dequantizer kernels, one a linear
    fin_g: Any  # post_attention_dot: gate_up's RMSNorm quantizer on o_proj's sum (+ x, y = h)
    fin_d: Any  # down's SwiGLU quantizer on gate_up's float32 sum


def _build(m: int, shapes, fused, gw_rows, stream: str = "main") -> _Plan:
    pro = [dataclasses.replace(f, residual=False) for f in fused]
    *_, (_, k_g), (_, k_d) = shapes
    fin_d = nvfp4_quant.FinishIn.dot(gw_rows[-2])
    fin_g = None
    if len(shapes) == 3:
        # o_proj's finish: its float32 sum, the residual x, h stored; then gate_up's RMSNorm
        # quantizer with the quantizer kernel's chunking and threads (the sum order)
        fin = dataclasses.replace(nvfp4_quant.FinishIn.dot(gw_rows[0]), residual=True,
                                  store_y=True)  # fmt: skip
        fin_g = nvfp4_quant.build(m, k_g, pro[1], out="xhat_bf16", finish=fin)
    return _Plan(
        quant=nvfp4_quant.build(m, shapes[0][1], pro[0], out="xhat_bf16"),
        dq=tuple(dataclasses.replace(nvfp4_dequant.build(n, k), stream=stream) for n, k in shapes),
        fin_g=fin_g,
        fin_d=nvfp4_quant.build(m, k_d, pro[-1], out="xhat_bf16", finish=fin_d),
    )


def _finish(kernel, acc, xgp, res, wg, xg, nw, layer, y_cols: int):
    """(y bf16 [M, y_cols] or a dummy, the next linear's values bf16 [M, K], global scale)."""
    m = acc.shape[0]
    outs = (
        jax.ShapeDtypeStruct((m, y_cols) if kernel.finish.store_y else (1,), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, kernel.k), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    return _dispatch.ptx_call(kernel.backend_config(), outs, acc, xgp, res, wg, xg, nw, layer)


def _kernels(*args, shapes, fused, plan: _Plan):
    """The first linear's quantizer, values and float32 sum; each next quantizer on the sum
    (o_proj's: + x and stores h); down's dot; + the residual."""
    o, x, (xg_g, nw, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer) = _split(args, shapes)
    dummy = jnp.zeros((1,), jnp.bfloat16)
    if o is not None:
        out, xg_o, wp_o, ws_o, wg_o = o
        pro = dataclasses.replace(fused[0], residual=False)
        xv, xgr = fl._quant_xbf16_p.bind(out, xg_o, dummy, layer, k=shapes[0][1], fused=pro,
                                         kernel=plan.quant)  # fmt: skip
        acc = nvfp4.x_values_sum(xv, dequant_call(wp_o, ws_o, layer, kernel=plan.dq[0]))
        x, xv, xgr = _finish(plan.fin_g, acc, xgr, x, wg_o, xg_g, nw, layer, shapes[0][0])
    else:
        pro = dataclasses.replace(fused[0], residual=False)
        xv, xgr = fl._quant_xbf16_p.bind(x, xg_g, nw, layer, k=shapes[0][1], fused=pro,
                                         kernel=plan.quant)  # fmt: skip
    acc = nvfp4.x_values_sum(xv, dequant_call(wp_g, ws_g, layer, kernel=plan.dq[-2]))
    _, hv, hg = _finish(plan.fin_d, acc, xgr, dummy, wg_g, xg_d, dummy, layer, 1)
    return x + dot_with_values(hv, hg, wp_d, ws_d, wg_d, layer, kernel=plan.dq[-1])


def _lower_reference(ctx, *args, shapes, fused, gw_rows, bind):
    _dispatch.refuse_off_cuda(OP, dict(bind)["impl"], ctx.module_context.platforms)
    fn = functools.partial(_composed, shapes=shapes, fused=fused, gw_rows=gw_rows, bind=bind)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


@functools.cache
def _note_composed(why: str) -> None:
    """Logs once per reason that the op runs as its fused linears (their own CUDA lowering,
    not a reference path)."""
    _LOG.warning("%s: the linears run as fused linears: %s", OP, why)


def _lower_cuda(ctx, *args, shapes, fused, gw_rows, bind):
    m = ctx.avals_in[0].shape[0]
    params = dict(bind)
    ok, why = dot_block_supported(m, shapes, params["gemm_options"])
    if ok and params["launch"] != "ptx":
        ok, why = False, f"launch={params['launch']!r} (the kernels need the PTX custom call)"
    plan = None
    if ok and params["impl"] != "ref":
        try:
            plan = _build(m, shapes, fused, gw_rows, params["gemm_options"].dot_stream)
        except nvfp4_gemv.KernelError as err:
            ok, why = False, f"kernel build failed: {err}"
            _note_composed(why)
    if plan is not None:
        fn = functools.partial(_kernels, shapes=shapes, fused=fused, plan=plan)
        return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)
    if params["impl"] == "cuda" and not ok:
        raise ValueError(f"{OP}(impl='cuda') cannot run: {why}")
    fn = functools.partial(_composed, shapes=shapes, fused=fused, gw_rows=gw_rows, bind=bind)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


mlir.register_lowering(_dot_block_p, _lower_reference)
mlir.register_lowering(_dot_block_p, _lower_cuda, platform="cuda")


# ----------------------------------------------------------------------------- API


def _check_common(impl, kernels, gemm_options) -> None:
    _dispatch.check_impl(impl)
    if kernels not in fl.KERNELS:
        raise ValueError(f"kernels={kernels!r}, expected one of {fl.KERNELS}")
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004


def _check_rows(name: str, a, cols: int) -> None:
    if np.ndim(a) != 2 or np.shape(a)[1] != cols or np.dtype(a.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"{name} {np.shape(a)} {np.dtype(a.dtype)}, expected [M, {cols}] bfloat16")


def _bind(head: tuple, linears: tuple, norm, layer, eps, bind: tuple, m: int, d: int):
    """Checks the linears' weights and the norm, then binds the primitive on `head` (the
    leading operands) and the linears' (params, prologue, residual)."""
    ws = [fl._w4a4_weight(f"{OP} {name}", p, layer) for name, p, *_ in linears]
    shapes = tuple(w.shape for w in ws)
    *o, (n_g, k_g), (n_d, k_d) = shapes
    if n_g != 2 * k_d or n_d != k_g or (o and o[0][0] != k_g):
        names = ", ".join(f"{name} {w.shape}" for (name, *_), w in zip(linears, ws, strict=True))
        raise ValueError(f"linear shapes {names}: expected o_proj [D, K], gate_up [2F, D], "
                         "down [D, F]")  # fmt: skip
    stacked_norm = np.ndim(norm) == 2
    want = (*ws[-2].stack, k_g) if stacked_norm else (k_g,)
    if tuple(np.shape(norm)) != want:
        raise ValueError(
            f"norm.shape={np.shape(norm)}, expected {(k_g,)} or {(*ws[-2].stack, k_g)}"
        )
    if m == 0:
        return jnp.zeros((0, d), jnp.bfloat16)
    ops, fused = [], []
    for (_, params, prologue, residual), w in zip(linears, ws, strict=True):
        scale = params.get("input_scale")
        stacked = scale is not None and np.ndim(scale) == 1 and layer is not None
        fused.append(nvfp4_gemv.Fused(
            prologue=prologue, residual=residual, dynamic=scale is None,
            eps=float(eps) if prologue == "rmsnorm" else 1e-6,
            norm_stacked=stacked_norm and prologue == "rmsnorm", scale_stacked=stacked,
        ))  # fmt: skip
        ops.append([
            jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (-1,)),
            w.packed, jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
            jnp.asarray(w.global_scale, jnp.float32),
        ])  # fmt: skip
    (xg_g, *w_g), (xg_d, *w_d) = ops[-2:]
    o_ops = ops[0] if len(ops) == 3 else []
    args = (*head, *o_ops, xg_g, jnp.asarray(norm, jnp.bfloat16), *w_g, xg_d, *w_d,
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()))  # fmt: skip
    return _dot_block_p.bind(*args, shapes=shapes, fused=tuple(fused),
                             gw_rows=tuple(w.per_row for w in ws), bind=bind)  # fmt: skip


def _bind_params(impl, options, kernels, gemm_options, residual_epilogue) -> tuple:
    return (
        ("impl", impl), ("launch", _dispatch.default_launch() if impl != "ref" else "ptx"),
        ("options", options), ("kernels", kernels), ("gemm_options", gemm_options),
        ("residual_epilogue", bool(residual_epilogue)),
    )  # fmt: skip


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
    _check_common(impl, kernels, gemm_options)
    d = fl._w4a4_weight(f"{OP} gate_up_proj", gate_up, layer).shape[1]
    _check_rows("x", x, d)
    linears = (("gate_up_proj", gate_up, "rmsnorm", False), ("down_proj", down, "swiglu", True))
    bind = _bind_params(impl, options, kernels, gemm_options, residual_epilogue)
    return _bind((x,), linears, norm, layer, eps, bind, np.shape(x)[0], d)


def post_attention_dot(
    out: jax.Array,
    x: jax.Array,
    o_proj: dict,
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
    """h + down(swiglu(gate_up(rms_norm(h, norm, eps)))) with h = x + o_proj(out), as one op:
    exactly `fused_linear(out, o_proj, residual=x)` then `mlp_dot(h, ...)`'s two fused linears
    (the same `impl`, `options`, `kernels`, `gemm_options`, `residual_epilogue`). On CUDA
    where `dot_block_supported` holds, gate_up's quantizer reads o_proj's float32 dot sum and
    the residual (and stores h) and down's reads gate_up's; elsewhere the three fused linears'
    own lowering.

    Args:
        out: [M, K] bf16, the attention's output.
        x: [M, D] bf16, the residual stream.
        o_proj, gate_up, down: W4A4 params (`rejax.ops.fused_linear.fusable`): [D, K],
            [2F, D] (gate rows first), [D, F].
        layer, norm, eps, impl, options, kernels, gemm_options, residual_epilogue: as
            `mlp_dot`.

    Returns:
        bf16 [M, D].
    """
    _check_common(impl, kernels, gemm_options)
    n_o, k_o = fl._w4a4_weight(f"{OP} o_proj", o_proj, layer).shape
    _check_rows("out", out, k_o)
    _check_rows("x", x, n_o)
    if np.shape(out)[0] != np.shape(x)[0]:
        raise ValueError(f"out has {np.shape(out)[0]} rows and x {np.shape(x)[0]}: expected equal")
    linears = (
        ("o_proj", o_proj, "none", True),
        ("gate_up_proj", gate_up, "rmsnorm", False),
        ("down_proj", down, "swiglu", True),
    )
    bind = _bind_params(impl, options, kernels, gemm_options, residual_epilogue)
    return _bind((out, x), linears, norm, layer, eps, bind, np.shape(x)[0], n_o)
