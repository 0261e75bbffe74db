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
that rounding. Everything else (M > 8, per-shard input scales, W4A16) is the composition.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import nvfp4_gemv
from rejax import layers, nvfp4
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch
from rejax.ops.linear import _weight

OP = "nvfp4_fused_linear"
PROLOGUES = nvfp4_gemv.PROLOGUES


# ----------------------------------------------------------------------------- reference


def _reference(x, xg, nw, res, wp, ws, wg, layer, *, n, k, fused, order="auto", **_: Any):
    """The unfused composition on the primitive's operands (see `fused_linear`)."""
    if fused.prologue == "rmsnorm":
        scale = layers.take(nw, layer) if fused.norm_stacked else nw
        h = layers.rms_norm(x, scale, fused.eps)
    elif fused.prologue == "swiglu":
        h = layers.swiglu(x[:, :k], x[:, k:])
    else:
        h = x
    scale = None if fused.dynamic else xg[0]
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


def _lower_cuda(ctx, *args, **params):
    m = ctx.avals_in[0].shape[0]
    n, k = params["n"], params["k"]
    supported = nvfp4_gemv.check_shape("w4a4x", m, n, k)
    kernel = None
    if supported[0] and params["impl"] != "ref":
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
    if params["launch"] == "ptx":
        return jax.ffi.ffi_lowering(
            "__gpu$xla.gpu.ptx", api_version=2, backend_config=kernel.backend_config()
        )(ctx, *args)
    fn = functools.partial(_callback_impl, kernel=kernel)
    return mlir.lower_fun(fn, multiple_results=False)(ctx, *args)


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
) -> jax.Array:
    """y = [residual +] nvfp4_linear(prologue(x)) as one op (one kernel launch on CUDA, M <= 8).

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

    Returns:
        bf16 [..., N].
    """
    _dispatch.check_impl(impl)
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
    if m == 0:
        return jnp.zeros((*lead, n), jnp.bfloat16)
    scale = params.get("input_scale")
    if scale is not None:
        scale = layers.take(scale, layer) if np.ndim(scale) == 1 else scale
    fused = nvfp4_gemv.Fused(
        prologue=prologue,
        residual=residual is not None,
        dynamic=scale is None,
        eps=float(eps),
        norm_stacked=stacked_norm,
    )
    if impl == "cuda":
        ok, why = nvfp4_gemv.check_shape("w4a4x", m, n, k)
        if not ok:
            raise ValueError(f"fused_linear(impl='cuda'): {why}")
    one = jnp.zeros((1,), jnp.bfloat16)
    args = (
        jnp.reshape(x, (m, width)),
        jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (1,)),
        one if norm is None else jnp.asarray(norm, jnp.bfloat16),
        jnp.zeros((1, 1), jnp.bfloat16) if residual is None else jnp.reshape(residual, (m, n)),
        w.packed,
        jax.lax.bitcast_convert_type(w.scales, jnp.uint8),
        jnp.asarray(w.global_scale, jnp.float32),
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
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
    )
    return jnp.reshape(y, (*lead, n))
