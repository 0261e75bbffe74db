"""The NVFP4 linear: one primitive, a pure-JAX reference lowering and a CUDA kernel lowering.

GEMM letters in this file (as in cuda_ops): M rows of x (decode tokens), N out features, K in
features. `nvfp4_linear` is the only place that chooses between the reference numerics of
`rejax.nvfp4` and the CUDA small-M GEMV in `cuda_ops/nvfp4_gemv.cu`:

* every platform lowers the primitive to the reference (`mlir.lower_fun`), so CPU tracing never
  touches NVRTC or the custom call;
* the `platform="cuda"` lowering compiles the kernel with NVRTC (lazily, cached on disk) and emits
  either XLA's own PTX custom-kernel call (`__gpu$xla.gpu.ptx`, launch "ptx") or a
  command-buffer-compatible `buffer_callback` that launches the same PTX through cuda-python
  (launch "callback"). Both run on XLA's stream and are captured in XLA command buffers.

`impl="auto"` uses the kernel when lowering for CUDA and the shape is supported (M <= 8 after
folding leading dims, K % 256 == 0, activations fit in shared memory); otherwise the reference,
with a one-time warning for unsupported shapes on CUDA (M > 8, prefill, is a GEMM and takes the
reference's bf16 tensor-core dot silently). `impl="cuda"` forces the kernel and raises
if it cannot run; `impl="ref"` forces the reference.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from rejax import nvfp4
from rejax.nvfp4 import Nvfp4Tensor

_LOG = logging.getLogger(__name__)

IMPLS = ("auto", "ref", "cuda")
ACTS = ("w4a4", "w4a16")
LAUNCHES = ("ptx", "callback")
# Environment variable that pins the CUDA launch path ("ptx" or "callback"); unset -> probe.
LAUNCH_ENV = "REJAX_GEMV_LAUNCH"
MAX_M = 8

_FLOAT_DTYPES = (np.dtype(jnp.bfloat16), np.dtype(np.float16), np.dtype(np.float32))


# ----------------------------------------------------------------------------- reference


def _as_e4m3(s: jax.Array) -> jax.Array:
    return jax.lax.bitcast_convert_type(s, jnp.float8_e4m3fn)


def _reference(*args, act: str, n: int, k: int, **_: Any) -> jax.Array:
    """Reference numerics on the primitive's operands (see `_operands`)."""
    if act == "w4a4":
        xp, xs, xg, wp, ws, wg = args
        m = xp.shape[0]
        xq = Nvfp4Tensor(packed=xp, scales=_as_e4m3(xs), global_scale=xg, shape=(m, k))
        w = Nvfp4Tensor(packed=wp, scales=_as_e4m3(ws), global_scale=wg, shape=(n, k))
        return nvfp4.nvfp4_matmul_q(xq, w)
    x, wp, ws, wg = args
    w = Nvfp4Tensor(packed=wp, scales=_as_e4m3(ws), global_scale=wg, shape=(n, k))
    return nvfp4.nvfp4_matmul(x, w, act="w4a16")


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
    if params["impl"] == "cuda":
        raise ValueError(
            "nvfp4_linear(impl='cuda') needs the CUDA platform, but this computation is lowered "
            f"for {ctx.module_context.platforms}; use impl='auto' or 'ref'"
        )
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=False)(
        ctx, *args
    )


def _lower_cuda(ctx, *args, **params):
    from cuda_ops import nvfp4_gemv  # lazy: NVRTC / cuda-python only when lowering for CUDA

    m = ctx.avals_in[0].shape[0]
    try:
        kernel = nvfp4_gemv.build(params["act"], m, params["n"], params["k"])
    except nvfp4_gemv.KernelError as err:
        if params["impl"] == "cuda":
            raise
        _warn_once(("build", str(err)), f"nvfp4_linear: using the reference path: {err}")
        return _lower_reference(ctx, *args, **params)
    if params["launch"] == "ptx":
        return jax.ffi.ffi_lowering(
            "__gpu$xla.gpu.ptx", api_version=2, backend_config=kernel.backend_config()
        )(ctx, *args)
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


# ----------------------------------------------------------------------------- dispatch

_WARNED: set = set()


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warnings.warn(message, stacklevel=3)
        _LOG.warning(message)


@functools.cache
def _probe_launch() -> str:
    """Chooses the launch path once per process: env override, else probe "ptx" on the GPU."""
    forced = os.environ.get(LAUNCH_ENV)
    if forced:
        if forced not in LAUNCHES:
            raise ValueError(f"{LAUNCH_ENV}={forced!r}, expected one of {LAUNCHES}")
        return forced
    if not _on_cuda():
        return "ptx"
    try:
        from cuda_ops import nvfp4_gemv

        # The first call usually comes while a jitted function is being traced: evaluate the
        # probe eagerly instead of staging it into that trace.
        with jax.ensure_compile_time_eval():
            nvfp4_gemv.probe_ptx_launch(_gemv_call)
        return "ptx"
    except Exception as err:  # noqa: BLE001 - any failure of the internal target -> fallback
        _LOG.warning("nvfp4_linear: PTX custom call unusable (%s); using buffer_callback", err)
        return "callback"


def _on_cuda() -> bool:
    try:
        return jax.default_backend() == "gpu" and bool(jax.devices("cuda"))
    except RuntimeError:
        return False


def default_launch() -> str:
    """The launch path the CUDA lowering uses in this process ("ptx" or "callback")."""
    return _probe_launch()


def supported(act: str, m: int, n: int, k: int) -> tuple[bool, str]:
    """Whether the CUDA kernel handles this problem; (False, reason) otherwise."""
    from cuda_ops.nvfp4_gemv import check_shape

    return check_shape(act, m, n, k)


def _gemv_call(args, *, act, n, k, impl, launch):
    return _gemv_p.bind(*args, act=act, n=n, k=k, impl=impl, launch=launch)


def _operands(x2: jax.Array, w: Nvfp4Tensor, act: str, input_scale: Any):
    """Flat kernel operands: W4A4 (xp, xs, xg[M], wp, ws, wg[]); W4A16 (x, wp, ws, wg[])."""
    wp = w.packed
    ws = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    wg = jnp.asarray(w.global_scale, jnp.float32)
    if act == "w4a16":
        return (x2, wp, ws, wg)
    xq = nvfp4.quantize_activation(x2, input_scale)
    m = x2.shape[0]
    xg = jnp.broadcast_to(jnp.asarray(xq.global_scale, jnp.float32), (m,))
    xs = jax.lax.bitcast_convert_type(xq.scales, jnp.uint8)
    return (xq.packed, xs, xg, wp, ws, wg)


def _check_args(x: Any, w: Any, act: str, impl: str, input_scale: Any) -> None:
    if act not in ACTS:
        raise ValueError(f"act={act!r}, expected one of {ACTS}")
    if impl not in IMPLS:
        raise ValueError(f"impl={impl!r}, expected one of {IMPLS}")
    if not isinstance(w, Nvfp4Tensor):
        raise ValueError(f"w must be an Nvfp4Tensor, got {type(w).__name__}")  # noqa: TRY004
    shape = tuple(np.shape(x))
    if len(shape) < 1 or shape[-1] != w.k:
        raise ValueError(f"x.shape={shape} must end in K={w.k} (w.shape={w.shape})")
    if np.dtype(x.dtype) not in _FLOAT_DTYPES:
        raise ValueError(f"x.dtype={np.dtype(x.dtype)}, expected bfloat16, float16 or float32")
    if np.ndim(w.global_scale) != 0:
        raise ValueError(f"w.global_scale must be a scalar, got shape {np.shape(w.global_scale)}")
    if act == "w4a16" and input_scale is not None:
        raise ValueError("input_scale is only used with act='w4a4'; got one with act='w4a16'")


def nvfp4_linear(
    x: jax.Array,
    w: Nvfp4Tensor,
    *,
    input_scale: Any = None,
    act: str = "w4a4",
    impl: str = "auto",
) -> jax.Array:
    """NVFP4 linear y = x @ w.T with the reference numerics of `rejax.nvfp4.nvfp4_matmul`.

    Args:
        x: [..., K] bfloat16 (float16 / float32 accepted); leading dims fold into M.
        w: Nvfp4Tensor of shape (N, K) with a scalar global scale.
        input_scale: W4A4 static activation global scale (f32 scalar); None -> per-row dynamic.
        act: "w4a4" (activations quantized to NVFP4) or "w4a16" (bf16 activations).
        impl: "auto" (kernel on CUDA when supported, else reference), "ref", or "cuda" (kernel
            or an error saying why not).

    Returns:
        bfloat16 [..., N].
    """
    _check_args(x, w, act, impl, input_scale)
    lead = tuple(np.shape(x)[:-1])
    m = int(np.prod(lead, dtype=np.int64))
    n, k = w.shape
    x2 = jnp.reshape(x, (m, k))  # [M, K]
    use_kernel = impl != "ref" and m > 0
    if use_kernel:
        ok, why = supported(act, m, n, k)
        if ok and act == "w4a16" and x.dtype != jnp.bfloat16:
            # the kernel reads bf16 activations; the reference keeps float32 inputs exact
            ok, why = False, f"x.dtype={np.dtype(x.dtype)} (the W4A16 kernel reads bfloat16)"
        if not ok:
            if impl == "cuda":
                raise ValueError(f"nvfp4_linear(impl='cuda'): {why}")
            # M > 8 (prefill) is a GEMM: the reference's one bf16 dot over exactly dequantized
            # values runs on tensor cores, which is what it should do; other misses warn.
            if _on_cuda() and m <= MAX_M:
                _warn_once(("shape", act, m, n, k), f"nvfp4_linear: reference path for {why}")
            use_kernel = False
    if not use_kernel:
        y = nvfp4.nvfp4_matmul(x2, w, act=act, input_scale=input_scale)
    else:
        args = _operands(x2, w, act, input_scale)
        launch = default_launch() if impl != "ref" else "ptx"
        y = _gemv_call(args, act=act, n=n, k=k, impl=impl, launch=launch)
    return jnp.reshape(y, (*lead, n))
