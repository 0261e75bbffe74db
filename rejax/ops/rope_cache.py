"""The decode step's attention prologue as one op: q/k RMSNorm, RoPE and the KV-cache write.

For one new token per row, `rope_cache` takes the fused qkv projection's output and returns the
attention's query, with the rotated key and the value written into one layer of the stacked
bf16 KV cache:

    q, k_cache, v_cache = rope_cache(qkv, q_norm, k_norm, layer, positions, index, k_cache,
                                     v_cache, heads=N, kv_heads=K, head_dim=H, ...)

Its reference is the composition the decoder used before (`rejax.layers.rms_norm` for Qwen3's
q/k norms, `rejax.layers.rope`, `rejax.cache.write_kv`), so off CUDA the decoder is bitwise what
it was. On CUDA it is one launch of `cuda_ops/rope_cache.cu` instead of about seven XLA
kernels; the cache operands are aliased to the outputs, so the kernel writes the new slot in
place. The kernel's RMSNorm sums the mean square in its own order, so a q/k element may round
to the neighbouring bf16 value of the composition's (tests/test_rope_cache_gpu.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import rope_cache as kernel_mod
from cuda_ops.build import KernelError
from rejax import layers
from rejax.cache import write_kv
from rejax.ops import _dispatch

OP = "rope_cache"


def _reference(qkv, qn, kn, layer, positions, index, inv_freq, kc, vc, *, shape, theta):
    """The composition (see the module docstring) on the primitive's operands."""
    del inv_freq  # rope recomputes the same values
    b, n, kh, h = shape.batch, shape.heads, shape.kv_heads, shape.head_dim
    q = qkv[:, : n * h].reshape(b, 1, n, h)
    k = qkv[:, n * h : (n + kh) * h].reshape(b, 1, kh, h)
    v = qkv[:, (n + kh) * h :].reshape(b, 1, kh, h)
    if shape.qk_norm:
        q = layers.rms_norm(q, layers.take(qn, layer), shape.eps)
        k = layers.rms_norm(k, layers.take(kn, layer), shape.eps)
    pos = positions[:, None]
    q, k = layers.rope(q, pos, theta), layers.rope(k, pos, theta)
    kc, vc = write_kv(kc, vc, k, v, index if shape.index_rows else index[0], layer)
    return q[:, 0], kc, vc


_rope_p = Primitive("rejax_rope_cache")
_rope_p.multiple_results = True


def _abstract(qkv, qn, kn, layer, positions, index, inv_freq, kc, vc, *, shape, theta, impl):
    del qn, kn, layer, positions, index, inv_freq, theta, impl
    q = jax.core.ShapedArray((shape.batch, shape.heads, shape.head_dim), qkv.dtype)
    return q, jax.core.ShapedArray(kc.shape, kc.dtype), jax.core.ShapedArray(vc.shape, vc.dtype)


_rope_p.def_abstract_eval(_abstract)


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_rope_p.bind, **params))


_rope_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _lower_reference(ctx, *args, shape, theta, impl):
    _dispatch.refuse_off_cuda(OP, impl, ctx.module_context.platforms)
    fn = functools.partial(_reference, shape=shape, theta=theta)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _supported(ctx, shape) -> tuple[bool, str]:
    ok, why = kernel_mod.check_shape(shape)
    if not ok:
        return ok, why
    names = ("qkv", "q_norm", "k_norm", "", "", "", "", "k_cache", "v_cache")
    for name, aval in zip(names, ctx.avals_in, strict=True):
        if name and np.dtype(aval.dtype) != np.dtype(jnp.bfloat16):
            return False, f"{name} dtype {np.dtype(aval.dtype)} (the kernel takes bfloat16)"
    return True, ""


def _lower_cuda(ctx, *args, shape, theta, impl):
    supported = _supported(ctx, shape)
    kernel = None
    if supported[0] and impl != "ref":
        try:
            kernel = kernel_mod.build(shape)
        except KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(OP, impl, supported):
        fn = functools.partial(_reference, shape=shape, theta=theta)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return _dispatch.lower_ptx(
        ctx, *args, backend_config=kernel.backend_config(), aliases=kernel_mod.ALIASES
    )


mlir.register_lowering(_rope_p, _lower_reference)
mlir.register_lowering(_rope_p, _lower_cuda, platform="cuda")


def rope_cache(
    qkv: jax.Array,
    q_norm: jax.Array | None,
    k_norm: jax.Array | None,
    layer: jax.Array,
    positions: jax.Array,
    index: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    theta: float,
    impl: str = "auto",
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """q [B, N, H] and the caches with this token's k / v written at `layer`.

    Args:
        qkv: [B, (N + 2K) * H] the fused projection's output for one token per row (q heads,
            then k, then v).
        q_norm, k_norm: the stacked per-head RMSNorm weights [L, H] (Qwen3), or both None (no
            q/k norm, Qwen2).
        layer: int32 [] layer of the stacks.
        positions: [B] int32 positions of the tokens (-1 = padding: rotated like any position).
        index: [] int32 slot written in every row, or [B] int32 one slot per row (slots outside
            the cache are dropped).
        k_cache, v_cache: [L, B, S, K, H] the stacked cache (updated in place on CUDA).
        heads, kv_heads, head_dim: N, K, H.
        eps: the q/k norms' epsilon.
        theta: rope_theta.
        impl: "auto", "ref" or "cuda" (as the other ops).

    Returns:
        (q [B, N, H], k_cache, v_cache).
    """
    _dispatch.check_impl(impl)
    b = int(np.shape(qkv)[0])
    want = (b, (heads + 2 * kv_heads) * head_dim)
    if tuple(np.shape(qkv)) != want:
        raise ValueError(f"qkv.shape={np.shape(qkv)}, expected {want} (one token per row)")
    shape = rope_shape(b, q_norm, k_norm, positions, index, k_cache, v_cache, heads=heads,
                       kv_heads=kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip
    if impl == "cuda":
        ok, why = kernel_mod.check_shape(shape)
        if not ok:
            raise ValueError(f"rope_cache(impl='cuda'): {why}")
    norms, rest = rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache, head_dim, theta)
    return tuple(
        _rope_p.bind(
            qkv,
            *norms,
            jnp.asarray(layer, jnp.int32).reshape(()),
            *rest,
            shape=shape,
            theta=float(theta),
            impl=impl,
        )
    )


def rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache, head_dim, theta):
    """The kernel's operands around the layer: ((q_norm, k_norm) or bf16 dummies for Qwen2,
    (positions, index, inv_freq, k_cache, v_cache))."""
    dummy = jnp.zeros((1, head_dim), jnp.bfloat16)
    norms = (dummy if q_norm is None else q_norm, dummy if k_norm is None else k_norm)
    rest = (
        jnp.asarray(positions, jnp.int32),
        jnp.asarray(index, jnp.int32).reshape(-1),
        layers.rope_inv_freq(head_dim, theta),
        k_cache,
        v_cache,
    )
    return norms, rest


def rope_shape(
    b: int, q_norm, k_norm, positions, index, k_cache, v_cache, *, heads, kv_heads, head_dim, eps
) -> kernel_mod.Shape:
    """The kernel shape of `rope_cache`'s arguments for B rows, checked (ValueError naming the
    argument that does not fit)."""
    if (q_norm is None) != (k_norm is None):
        raise ValueError("pass both q_norm and k_norm (Qwen3) or neither (Qwen2)")
    cache_shape = tuple(np.shape(k_cache))
    if len(cache_shape) != 5 or cache_shape[1] != b or cache_shape[3:] != (kv_heads, head_dim):
        raise ValueError(
            f"k_cache.shape={cache_shape}, expected [L, {b}, S, {kv_heads}, {head_dim}]"
        )
    if tuple(np.shape(v_cache)) != cache_shape:
        raise ValueError(f"v_cache.shape={np.shape(v_cache)} != k_cache.shape={cache_shape}")
    if tuple(np.shape(positions)) != (b,):
        raise ValueError(f"positions.shape={np.shape(positions)}, expected {(b,)}")
    if np.ndim(index) not in (0, 1) or (np.ndim(index) == 1 and np.shape(index) != (b,)):
        raise ValueError(f"index.shape={np.shape(index)}, expected () or {(b,)}")
    qk_norm = q_norm is not None
    for name, w in (("q_norm", q_norm), ("k_norm", k_norm)):
        if w is not None and (np.ndim(w) != 2 or np.shape(w)[1] != head_dim):
            raise ValueError(f"{name}.shape={np.shape(w)}, expected [L, {head_dim}]")
    shape = kernel_mod.Shape(
        batch=b,
        heads=heads,
        kv_heads=kv_heads,
        head_dim=head_dim,
        slots=cache_shape[2],
        qk_norm=qk_norm,
        eps=float(eps),
        index_rows=np.ndim(index) == 1,
    )
    return shape
