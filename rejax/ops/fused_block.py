"""A W4A4 decoder layer's linears chained on the GEMM's rows: each K-split GEMM's finish inside
the next kernel (the next linear's quantizer, or the rope kernel), one launch instead of two.

GEMM letters as in rejax/ops/linear.py (M rows, N out features, K in features). The op is

    h = x + o_proj(out)
    y = h + down(swiglu(gate_up(rms_norm(h, norm, eps))))

the decoder's `fused_linear` composition (o_proj with the residual, gate_up with the RMSNorm
prologue, down with the SwiGLU prologue and the residual), and off CUDA it is that composition's
reference, bitwise. On CUDA, for the rows the tensor-core GEMM takes (`gemm_options.min_m` ..
`max_m`), the composition runs as the quantizer kernel, o_proj's GEMM, its split-K finish, the
quantizer of gate_up's input, gate_up's GEMM (and finish), the quantizer of down's input and
down's GEMM and finish: up to 9 launches. Where a GEMM splits K through float32 partials
(`GemmPlan.partials`, every linear of a Qwen3-8B layer at 8-64 rows but gate_up at 16), the op
replaces its finish and the next quantizer by one launch, `nvfp4_finish_quantize`
(`cuda_ops.nvfp4_quant.FinishIn`): it adds the partials as the finish kernel does (the same
bf16 values, and for o_proj the residual stream h it stores), then the next linear's prologue
and quantizer write its x_hat. The bytes equal the two launches' (the row statistics are
summed in the quantizer kernel's order; tests/test_fused_block_gpu.py checks it): a speed
choice, `Config.gemm_chain` "fused" ("split": the composition's launches; the default
"swiglu_rope", `chain_norm=False`, chains only gate_up's finish into down's quantizer, since
the RMSNorm finish-quantizer measured slower than the two launches it replaces).

`pre_attention_block` does the same before the attention (one new token a row, a bf16 cache):
qkv = fused_linear(x, qkv_proj, prologue="rmsnorm") then `rejax.ops.rope_cache.rope_cache`,
with the qkv GEMM's split-K finish inside the rope kernel (`cuda_ops.rope_cache.build(...,
finish=)`: it forms each qkv value as the finish kernel would store it), one launch fewer.
Across layers, `post_attention_block(..., next_qkv=, next_norm=)` also returns the next layer's
qkv input (`xhat_input` of its output at layer + 1; on CUDA down's finish and that quantizer are
one launch) and `pre_attention_block(..., xq=)` reads it (`rejax.decoder.cross_layer_chain`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import mlir

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from cuda_ops import rope_cache as rope_kernel
from rejax import nvfp4
from rejax.nvfp4 import Nvfp4Tensor
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl
from rejax.ops import linear as linear_ops
from rejax.ops import rope_cache as rope_ref
from rejax.ops.linear import gemm_call_xhat, prefers_dot, takes_wgmma

OP = "nvfp4_post_attention_block"
PRE_OP = "nvfp4_pre_attention_block"
XQ_OP = "nvfp4_xhat_input"
LINEARS = ("o_proj", "gate_up_proj", "down_proj")


def _scale_operand(params: dict) -> jax.Array:
    """A linear's input scale as the kernels take it: f32 [1] (1.0 when dynamic) or [L]."""
    scale = params.get("input_scale")
    return jnp.reshape(jnp.asarray(1.0 if scale is None else scale, jnp.float32), (-1,))


def _fused(params: dict, prologue: str, residual: bool, eps, stacked_norm: bool, layer):
    """The quantizer's compile-time description for a linear's params (as `fused_linear`)."""
    scale = params.get("input_scale")
    return nvfp4_gemv.Fused(
        prologue=prologue,
        residual=residual,
        dynamic=scale is None,
        eps=float(eps),
        norm_stacked=prologue == "rmsnorm" and stacked_norm,
        scale_stacked=scale is not None and np.ndim(scale) == 1 and layer is not None,
    )


def _weight_operands(w: Nvfp4Tensor) -> tuple:
    """(codes, E4M3 scale bytes, global scale f32) of a (stacked) weight."""
    scales = jax.lax.bitcast_convert_type(w.scales, jnp.uint8)
    return w.packed, scales, jnp.asarray(w.global_scale, jnp.float32)


def _rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache, head_dim, theta):
    """The rope kernel's operands after the layer (`rejax.ops.rope_cache.rope_operands`)."""
    norms, rest = rope_ref.rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache,
                                         head_dim, theta)  # fmt: skip
    return (*norms, *rest)


def _chain_rows(m: int, gemm_options: nvfp4_gemm.GemmOptions) -> tuple[bool, str]:
    """Whether M rows and the GEMM choices allow a chain at all: the GEMM's rows, the x_hat
    quantizer kernel, K splits through partials."""
    if m < gemm_options.min_m:
        return False, f"M={m} rows take the GEMV (gemm_options.min_m={gemm_options.min_m})"
    if prefers_dot("w4a4", m, "auto", gemm_options):
        return False, f"M={m} rows take the dot (gemm_options.max_m={gemm_options.max_m})"
    if takes_wgmma("w4a4", m, "auto", gemm_options):
        return False, (
            f"M={m} rows take the wgmma GEMM (gemm_options.wgmma_min_m={gemm_options.wgmma_min_m})"
        )
    if gemm_options.x_quant != "kernel":
        return False, f"gemm_options.x_quant={gemm_options.x_quant!r} (the chain needs 'kernel')"
    if gemm_options.reduce != "finish":
        return False, f"gemm_options.reduce={gemm_options.reduce!r} (no partials to finish)"
    return True, ""


def block_supported(
    m: int,
    shapes: tuple,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    chain_norm: bool = True,
) -> tuple[bool, str]:
    """(True, "") if the op's kernel chain serves M rows of the block whose linears have
    `shapes` ((n, k) of o_proj, gate_up_proj, down_proj), else (False, why): M in the GEMM's
    rows, every linear a GEMM shape, every input a quantizer kernel shape in its x_hat form,
    and at least one K split through partials to fuse (o_proj's, with `chain_norm`, or
    gate_up's)."""
    ok, why = _chain_rows(m, gemm_options)
    if not ok:
        return ok, why
    for name, (n, k) in zip(LINEARS, shapes, strict=True):
        ok, why = nvfp4_gemm.check_shape(m, n, k, gemm_options)
        if not ok:
            return False, f"{name}: {why}"
        ok, why = nvfp4_quant.check_shape(m, k)
        if not ok:
            return False, f"{name}'s input: {why}"
    sms = cbuild.device_sms()
    if not any(nvfp4_gemm.plan(m, n, k, sms, gemm_options).partials
               for n, k in shapes[0 if chain_norm else 1 : 2]):  # fmt: skip
        which = (
            "neither o_proj nor gate_up_proj splits"
            if chain_norm
            else "gate_up_proj does not split"
        )
        return False, f"M={m}: {which} K (nothing to fuse)"
    return True, ""


# ----------------------------------------------------------------------------- reference


def _reference(out, x, nw, *ops, shapes, fused, order="auto", **_: Any):
    """The composition of `fused_linear`'s references on the primitive's operands."""
    (xg_o, wp_o, ws_o, wg_o, xg_g, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer) = ops
    (n_o, k_o), (n_g, k_g), (n_d, k_d) = shapes
    f_o, f_g, f_d = fused
    one = jnp.zeros((1,), jnp.bfloat16)
    no_res = jnp.zeros((1, 1), jnp.bfloat16)
    h = fl._reference(out, xg_o, one, x, wp_o, ws_o, wg_o, layer, n=n_o, k=k_o, fused=f_o,
                      order=order)  # fmt: skip
    g = fl._reference(h, xg_g, nw, no_res, wp_g, ws_g, wg_g, layer, n=n_g, k=k_g, fused=f_g,
                      order=order)  # fmt: skip
    return fl._reference(g, xg_d, one, h, wp_d, ws_d, wg_d, layer, n=n_d, k=k_d, fused=f_d,
                         order=order)  # fmt: skip


def _next_layer(layer, n_layers: int):
    """The next layer's index in an L-layer stack (the last layer: itself, an unused input)."""
    return jnp.minimum(layer + 1, n_layers - 1)


def _reference_next(out, x, nw, *ops, shapes, fused, next_fused, next_layers, order="auto",
                    **_: Any):  # fmt: skip
    """`_reference`, and the next layer's qkv input (x_hat, global scale) of its result."""
    *ops, xg_q, nw_q = ops
    y = _reference(out, x, nw, *ops, shapes=shapes, fused=fused, order=order)
    # the next layer's RMSNorm reads y as a buffer, as it would after the layer loop's step
    # (XLA would otherwise fuse its reduction into y's producers, in another summation order)
    y = jax.lax.optimization_barrier(y)
    layer = _next_layer(ops[-1], next_layers)
    xh, xg = fl._xhat_reference(y, xg_q, nw_q, layer, k=shapes[0][0], fused=next_fused)
    return y, xh, xg


_block_p = Primitive("rejax_nvfp4_post_attention_block")
_block_p.def_abstract_eval(lambda out, x, *_, **__: jax.core.ShapedArray(x.shape, jnp.bfloat16))


@functools.cache
def _jitted_bind(**params):
    return jax.jit(functools.partial(_block_p.bind, **params))


_block_p.def_impl(lambda *args, **params: _jitted_bind(**params)(*args))


def _lower_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    return mlir.lower_fun(functools.partial(_reference, **params), multiple_results=False)(
        ctx, *args
    )


def _next_abstract(out, x, *_, **__):
    m, d = x.shape
    return (
        jax.core.ShapedArray((m, d), jnp.bfloat16),
        jax.core.ShapedArray((m, d), jnp.float16),
        jax.core.ShapedArray((m,), jnp.float32),
    )


# the block that also writes the next layer's qkv input: (y, x_hat, global scale)
_block_next_p = fl._jitted_primitive("rejax_nvfp4_post_attention_block_next", _next_abstract)


def _lower_next_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_reference_next, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


# ----------------------------------------------------------------------------- CUDA


@dataclasses.dataclass(frozen=True)
class _Chain:
    """The built kernels of one block: o_proj's quantizer, then per linear its GEMM and, for
    gate_up and down, either a finish-quantizer of the previous GEMM's partials (`fin`) or a
    quantizer of its bf16 output (`quant`)."""

    quant_o: Any
    gemm_o: Any
    fin_g: Any
    quant_g: Any
    gemm_g: Any
    fin_d: Any
    quant_d: Any
    gemm_d: Any
    fin_q: Any = None  # down's finish + the next layer's qkv quantizer
    quant_q: Any = None  # the next layer's qkv quantizer on y (down does not split K)


def _build_chain(
    m,
    shapes,
    fused,
    gw_rows,
    gemm_options,
    epilogue,
    norm_chunk,
    next_fused=None,
    next_layers=0,
    chain_norm=True,
    norm_cluster=False,
) -> _Chain:
    (n_o, k_o), (n_g, k_g), (n_d, k_d) = shapes
    f_o, f_g, f_d = (dataclasses.replace(f, residual=False) for f in fused)

    def gemm(n, k, rows, residual):
        return nvfp4_gemm.build(m, n, k, options=gemm_options, gw_rows=rows, residual=residual)

    def finish_of(kernel, residual, store_y, cluster=False):
        p = kernel.plan
        return nvfp4_quant.FinishIn(splitk=p.splitk, w_shift=p.w_shift, gw_rows=p.gw_rows,
                                    residual=residual, store_y=store_y,
                                    cluster=cluster)  # fmt: skip

    def norm_chunking(k):
        # (chunk, cluster) of an RMSNorm finish-quantizer: one CTA a row (the row in shared
        # memory), `norm_chunk`'s chunks, or with norm_cluster a cluster of CTAs a row
        if norm_cluster:
            chunk = norm_chunk or cluster_chunk(m, k, cbuild.device_sms())
            return chunk, chunk < k
        return norm_chunk or k, False

    quant_o = nvfp4_quant.build(m, k_o, f_o, out="xhat")
    gemm_o = gemm(n_o, k_o, gw_rows[0], False)
    fin_g = quant_g = None
    if gemm_o.plan.partials and chain_norm:
        # one CTA per row by default (the row formed once in shared memory: each partial read
        # once); the split path quantizer's threads, which fix the order of the RMSNorm sum:
        # the same bytes at any chunk
        chunk, cluster = norm_chunking(k_g)
        fin = finish_of(gemm_o, residual=True, store_y=True, cluster=cluster)
        threads = nvfp4_quant.default_threads(nvfp4_quant.default_chunk(k_g, "xhat"), "xhat")
        fin_g = nvfp4_quant.build(m, k_g, f_g, out="xhat", finish=fin, chunk=chunk,
                                  threads=threads)  # fmt: skip
    else:  # o_proj's GEMM (and finish) adds the residual; gate_up's quantizer reads h
        gemm_o = gemm(n_o, k_o, gw_rows[0], True)
        quant_g = nvfp4_quant.build(m, k_g, f_g, out="xhat")
    gemm_g = gemm(n_g, k_g, gw_rows[1], False)
    fin_d = quant_d = None
    if gemm_g.plan.partials:
        # SwiGLU with a static scale needs no row pass: the quantizer's chunks, each partial read
        # once; a dynamic scale's amax pass reads the row, so one CTA per row then
        chunk = k_d if f_d.dynamic else None
        fin_d = nvfp4_quant.build(m, k_d, f_d, out="xhat", chunk=chunk,
                                  finish=finish_of(gemm_g, False, False))  # fmt: skip
    else:
        quant_d = nvfp4_quant.build(m, k_d, f_d, out="xhat")
    gemm_d = gemm(n_d, k_d, gw_rows[2], epilogue)
    fin_q = quant_q = None
    if next_fused is not None:
        gemm_d = gemm(n_d, k_d, gw_rows[2], False)
        if gemm_d.plan.partials:  # chunked as gate_up's input
            chunk, cluster = norm_chunking(n_d)
            fin = dataclasses.replace(finish_of(gemm_d, True, True, cluster),
                                      next_layers=next_layers)  # fmt: skip
            threads = nvfp4_quant.default_threads(nvfp4_quant.default_chunk(n_d, "xhat"), "xhat")
            fin_q = nvfp4_quant.build(m, n_d, next_fused, out="xhat", finish=fin, chunk=chunk,
                                      threads=threads)  # fmt: skip
        else:
            gemm_d = gemm(n_d, k_d, gw_rows[2], True)
            quant_q = nvfp4_quant.build(m, n_d, next_fused, out="xhat")
    return _Chain(quant_o, gemm_o, fin_g, quant_g, gemm_g, fin_d, quant_d, gemm_d, fin_q, quant_q)


def cluster_chunk(m: int, k: int, sms: int) -> int:
    """Elements a CTA of an RMSNorm finish-quantizer cluster takes (`norm_cluster`): the fewest
    CTAs a row, of 2, 4 or 8, that give M rows at least one CTA an SM (else 8), each chunk a
    multiple of 256 dividing K; K itself (one CTA, no cluster) where no such chunk exists."""
    sizes = [c for c in (2, 4, 8) if k % c == 0 and (k // c) % 256 == 0]
    if not sizes:
        return k
    return k // next((c for c in sizes if m * c >= sms), sizes[-1])


def _partials(kernel, xh, xg, wp, ws, wg, layer):
    """A K-split GEMM's float32 partials [S, M, N] (its main entry alone)."""
    part = jax.ShapeDtypeStruct(kernel.plan.out_shape, jnp.float32)
    return _dispatch.ptx_call(kernel.backend_config(), part, xh, xg, wp, ws, wg, layer)


def _finish_quant(kernel, part, xgp, res, wg, xg, nw, layer, m, width):
    """(y bf16 [M, width] or a dummy, x_hat f16 [M, K], global scale f32 [M])."""
    f = kernel.finish
    outs = (
        jax.ShapeDtypeStruct((m, width) if f.store_y else (1,), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, kernel.k), jnp.float16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    return _dispatch.ptx_call(kernel.backend_config(), outs, part, xgp, res, wg, xg, nw, layer)


def _chain(out, x, nw, *ops, shapes, fused, chain: _Chain, gemm_options, epilogue,
           next_fused=None, next_layers=0):  # fmt: skip
    if next_fused is not None:
        *ops, xg_q, nw_q = ops
    (xg_o, wp_o, ws_o, wg_o, xg_g, wp_g, ws_g, wg_g, xg_d, wp_d, ws_d, wg_d, layer) = ops
    (n_o, k_o), (n_g, k_g), (n_d, k_d) = shapes
    f_o, f_g, f_d = (dataclasses.replace(f, residual=False) for f in fused)
    m = x.shape[0]
    one = jnp.zeros((1,), jnp.bfloat16)
    no_res = jnp.zeros((1, 1), jnp.bfloat16)
    c = chain
    xh, xgr = fl._quant_xhat_p.bind(out, xg_o, one, layer, k=k_o, fused=f_o, kernel=c.quant_o)
    if c.fin_g is not None:
        part = _partials(c.gemm_o, xh, xgr, wp_o, ws_o, wg_o, layer)
        h, xh, xgr = _finish_quant(c.fin_g, part, xgr, x, wg_o, xg_g, nw, layer, m, n_o)
    else:
        h = gemm_call_xhat(xh, xgr, wp_o, ws_o, wg_o, layer, n=n_o, gw_rows=c.gemm_o.plan.gw_rows,
                           gemm_options=gemm_options, residual=x)  # fmt: skip
        xh, xgr = fl._quant_xhat_p.bind(h, xg_g, nw, layer, k=k_g, fused=f_g, kernel=c.quant_g)
    if c.fin_d is not None:
        part = _partials(c.gemm_g, xh, xgr, wp_g, ws_g, wg_g, layer)
        _, xh, xgr = _finish_quant(c.fin_d, part, xgr, no_res, wg_g, xg_d, one, layer, m, n_g)
    else:
        g = gemm_call_xhat(xh, xgr, wp_g, ws_g, wg_g, layer, n=n_g, gw_rows=c.gemm_g.plan.gw_rows,
                           gemm_options=gemm_options)  # fmt: skip
        xh, xgr = fl._quant_xhat_p.bind(g, xg_d, one, layer, k=k_d, fused=f_d, kernel=c.quant_d)
    if c.fin_q is not None:  # down's finish and the next layer's qkv quantizer in one launch
        part = _partials(c.gemm_d, xh, xgr, wp_d, ws_d, wg_d, layer)
        return _finish_quant(c.fin_q, part, xgr, h, wg_d, xg_q, nw_q, layer, m, n_d)
    if c.quant_q is not None:
        y = gemm_call_xhat(xh, xgr, wp_d, ws_d, wg_d, layer, n=n_d, gw_rows=c.gemm_d.plan.gw_rows,
                           gemm_options=gemm_options, residual=h)  # fmt: skip
        li = _next_layer(layer, next_layers)
        xq = fl._quant_xhat_p.bind(y, xg_q, nw_q, li, k=n_d, fused=next_fused, kernel=c.quant_q)
        return (y, *xq)
    y = gemm_call_xhat(xh, xgr, wp_d, ws_d, wg_d, layer, n=n_d, gw_rows=c.gemm_d.plan.gw_rows,
                       gemm_options=gemm_options, residual=h if epilogue else None)  # fmt: skip
    return y if epilogue else h + y


def _lower_cuda(ctx, *args, shapes, fused, gw_rows, impl, gemm_options, epilogue, norm_chunk,
                chain_norm=True, norm_cluster=False, next_fused=None,
                next_layers=0):  # fmt: skip
    m = ctx.avals_in[0].shape[0]
    supported = block_supported(m, shapes, gemm_options, chain_norm)
    chain = None
    if supported[0] and impl != "ref":
        try:
            chain = _build_chain(m, shapes, fused, gw_rows, gemm_options, epilogue, norm_chunk,
                                 next_fused, next_layers, chain_norm, norm_cluster)  # fmt: skip
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    nxt = {} if next_fused is None else {"next_fused": next_fused, "next_layers": next_layers}
    if not _dispatch.use_kernel(OP, impl, supported):
        # the composition, each matmul as one bf16 tensor-core dot (rejax/ops/linear.py)
        ref = _reference if next_fused is None else _reference_next
        fn = functools.partial(ref, shapes=shapes, fused=fused, order="dot", **nxt)
        return mlir.lower_fun(fn, multiple_results=next_fused is not None)(ctx, *args)
    fn = functools.partial(_chain, shapes=shapes, fused=fused, chain=chain,
                           gemm_options=gemm_options, epilogue=epilogue, **nxt)  # fmt: skip
    return mlir.lower_fun(fn, multiple_results=next_fused is not None)(ctx, *args)


mlir.register_lowering(_block_p, _lower_reference)
mlir.register_lowering(_block_p, _lower_cuda, platform="cuda")
mlir.register_lowering(_block_next_p, _lower_next_reference)
mlir.register_lowering(_block_next_p, _lower_cuda, platform="cuda")


# ----------------------------------------------------------------------------- API


def post_attention_block(
    out: jax.Array,
    x: jax.Array,
    o_proj: dict,
    gate_up: dict,
    down: dict,
    *,
    norm: jax.Array,
    layer: Any = None,
    eps: float = 1e-6,
    impl: str = "auto",
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    residual_epilogue: bool = True,
    norm_chunk: int | None = None,
    next_qkv: dict | None = None,
    next_norm: jax.Array | None = None,
    chain_norm: bool = True,
    norm_cluster: bool = False,
) -> jax.Array | tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """h = x + o_proj(out); h + down(swiglu(gate_up(rms_norm(h, norm, eps)))) for W4A4 linears,
    with each K-split GEMM's finish and the next quantizer in one launch on CUDA (see the
    module docstring).

    Args:
        out: [..., K_o] bf16, o_proj's input (the attention's output).
        x: [..., D] bf16, the residual stream (D = o_proj's and down's N, gate_up's K).
        o_proj, gate_up, down: W4A4 params as `fused_linear` takes them (`fused_linear.fusable`;
            gate_up's N = 2F, down's K = F), stacked [L, ...] exactly when `layer` is given.
        norm: the RMSNorm weight in front of gate_up, [D] or stacked [L, D].
        layer: int32 [] index into stacked params (may be traced).
        eps: the RMSNorm epsilon.
        impl: "auto", "ref" or "cuda" (as `rejax.ops.linear.nvfp4_linear`; "cuda" fails on rows
            or shapes the chain does not serve, `block_supported` says why).
        gemm_options: the GEMMs' choices (`min_m` .. `max_m` are the rows the chain takes).
        residual_epilogue: down's GEMM adds the residual in its epilogue (else a bf16 add;
            the same value), as `fused_linear`'s.
        norm_chunk: elements of a row that each CTA of an RMSNorm finish-quantizer (o_proj's;
            with next_qkv also down's) quantizes (a multiple of 256 dividing D). None: the
            whole row, one CTA per row (with norm_cluster: `cluster_chunk`'s), which forms the
            row once in shared memory (each partial read once); a smaller chunk spreads the
            rows over more CTAs, each of which reads the whole row's partials for the RMSNorm
            statistic. The bytes are the same either way.
        next_qkv, next_norm: with a decoder's stacks of the qkv projection's W4A4 params and
            its input RMSNorm weight [L, D] (both stacked, `layer` given), also return the
            next layer's qkv input, `xhat_input(y, next_qkv, next_norm, layer=min(layer + 1,
            L - 1))`: on CUDA down's split-K finish and that quantizer are one launch.
        chain_norm: o_proj's split-K finish and gate_up's RMSNorm quantizer in one launch
            (True), or as two (False: only gate_up's finish is chained, into down's SwiGLU
            quantizer). The RMSNorm's row statistic holds the fused launch to one CTA a row
            (or to rereading the row), and at 8-64 rows it measured slower than the two
            launches on the H100 (experiments/results/h100_chain/).
        norm_cluster: the RMSNorm finish-quantizers (o_proj -> gate_up; with next_qkv, down ->
            the next qkv) run a row's CTAs as one thread-block cluster
            (`cuda_ops.nvfp4_quant.FinishIn.cluster`): each forms its chunk once in shared
            memory, the statistic reads the row through distributed shared memory; chunks of
            `norm_chunk` (2-8 a row) or by default `cluster_chunk`'s. The same bytes.

    Returns:
        bf16 [..., D]; with `next_qkv` (y [M, D], (x_hat f16 [M, D], global scale f32 [M])).

    Where the chain does not apply (other rows, an unsupported shape, nothing to fuse) this is
    the three `fused_linear` calls (kernels "two"), which the decoder runs otherwise.
    """
    _dispatch.check_impl(impl)
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004
    ws: list[Nvfp4Tensor] = []
    for name, params in zip(LINEARS, (o_proj, gate_up, down), strict=True):
        ws.append(fl._w4a4_weight(f"post_attention_block's {name}", params, layer))
    shapes = tuple(w.shape for w in ws)
    (n_o, k_o), (n_g, k_g), (n_d, k_d) = shapes
    if not (n_o == k_g == n_d and n_g == 2 * k_d):
        raise ValueError(
            f"linear shapes o_proj {shapes[0]}, gate_up_proj {shapes[1]}, down_proj {shapes[2]}: "
            "expected o_proj (D, K), gate_up_proj (2F, D), down_proj (D, F)"
        )
    lead = tuple(np.shape(x)[:-1])
    if tuple(np.shape(x)) != (*lead, n_o) or tuple(np.shape(out)) != (*lead, k_o):
        raise ValueError(
            f"out.shape={np.shape(out)}, x.shape={np.shape(x)}: expected (..., {k_o}) and "
            f"(..., {n_o}) with the same leading dims"
        )
    for name, a in (("out", out), ("x", x)):
        if np.dtype(a.dtype) != np.dtype(jnp.bfloat16):
            raise ValueError(
                f"{name}.dtype={np.dtype(a.dtype)}: post_attention_block takes bfloat16"
            )
    stacked_norm = np.ndim(norm) == 2
    want = (*ws[1].stack, k_g) if stacked_norm else (k_g,)
    if tuple(np.shape(norm)) != want:
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k_g,)} or {(*ws[1].stack, k_g)}")
    if norm_chunk is not None and (
        not isinstance(norm_chunk, int) or norm_chunk <= 0 or norm_chunk % 256 or k_g % norm_chunk
    ):
        raise ValueError(f"norm_chunk={norm_chunk!r}: expected a multiple of 256 dividing {k_g}")
    if norm_cluster and norm_chunk is not None and not 2 <= k_g // norm_chunk <= 8:
        raise ValueError(
            f"norm_chunk={norm_chunk} with norm_cluster: {k_g // norm_chunk} CTAs a row of "
            f"{k_g}, expected 2..8 (a cluster)"
        )
    m = int(np.prod(lead, dtype=np.int64))
    next_fused = next_layers = None
    if next_qkv is not None:
        next_fused, next_layers = _next_input(next_qkv, next_norm, n_o, layer, eps)

    def composed():
        common = {"layer": layer, "impl": impl, "kernels": "two", "gemm_options": gemm_options}
        h = fl.fused_linear(out, o_proj, residual=x, residual_epilogue=residual_epilogue, **common)
        g = fl.fused_linear(h, gate_up, prologue="rmsnorm", norm=norm, eps=eps, **common)
        y = fl.fused_linear(g, down, prologue="swiglu", residual=h,
                            residual_epilogue=residual_epilogue, **common)  # fmt: skip
        if next_qkv is None:
            return y
        y = jax.lax.optimization_barrier(jnp.reshape(y, (m, n_o)))  # as in _reference_next
        li = _next_layer(jnp.asarray(layer, jnp.int32), next_layers)
        return y, xhat_input(y, next_qkv, next_norm, layer=li, eps=eps, impl=impl)

    ok, why = block_supported(m, shapes, gemm_options, chain_norm) if m else (False, "no rows")
    if impl == "ref" or not ok:
        if impl == "cuda" and not ok:
            raise ValueError(f"post_attention_block(impl='cuda'): {why}")
        return composed()
    ops, fused = [], []
    for (params, w), (prologue, residual) in zip(
        ((o_proj, ws[0]), (gate_up, ws[1]), (down, ws[2])),
        (("none", True), ("rmsnorm", False), ("swiglu", True)),
        strict=True,
    ):
        fused.append(_fused(params, prologue, residual, eps, stacked_norm, layer))
        ops += [_scale_operand(params), *_weight_operands(w)]
    args = (
        jnp.reshape(out, (m, k_o)),
        jnp.reshape(x, (m, n_o)),
        jnp.asarray(norm, jnp.bfloat16),
        *ops,
        jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
    )
    params = {
        "shapes": shapes,
        "fused": tuple(fused),
        "gw_rows": tuple(w.per_row for w in ws),
        "impl": impl,
        "gemm_options": gemm_options,
        "epilogue": bool(residual_epilogue),
        "norm_chunk": norm_chunk,
        "chain_norm": bool(chain_norm),
        "norm_cluster": bool(norm_cluster),
    }
    if next_qkv is not None:
        y, xh, xg = _block_next_p.bind(
            *args, _scale_operand(next_qkv), jnp.asarray(next_norm, jnp.bfloat16),
            next_fused=next_fused,
            next_layers=next_layers, **params,
        )  # fmt: skip
        return y, (xh, xg)
    y = _block_p.bind(*args, **params)
    return jnp.reshape(y, (*lead, n_o))


def _next_input(qkv: dict, norm, d: int, layer, eps) -> tuple[nvfp4_gemv.Fused, int]:
    """(the quantizer's Fused, L) of the next layer's qkv input from a decoder's stacks."""
    w = fl._w4a4_weight("the next layer's qkv_proj", qkv, layer)
    n_layers = w.stack[0] if w.stack else 0
    if not n_layers or tuple(np.shape(norm)) != (n_layers, d) or w.shape[1] != d:
        raise ValueError(
            f"next_qkv {w.shape} stack {w.stack}, next_norm.shape={np.shape(norm)}: expected "
            f"stacks of L layers, (N, {d}) and [L, {d}]"
        )
    scale = qkv.get("input_scale")
    if scale is not None and tuple(np.shape(scale)) != (n_layers,):
        raise ValueError(f"next_qkv input_scale shape {np.shape(scale)}, expected ({n_layers},)")
    return _fused(qkv, "rmsnorm", False, eps, True, layer), n_layers


# ----------------------------------------------------------------------------- x_hat input


def _xq_abstract(x, *_, k, **__):
    return (
        jax.core.ShapedArray((x.shape[0], k), jnp.float16),
        jax.core.ShapedArray((x.shape[0],), jnp.float32),
    )


_xq_p = fl._jitted_primitive("rejax_nvfp4_xhat_input", _xq_abstract)


def _lower_xq_reference(ctx, *args, k, fused, impl):
    _dispatch.refuse_off_cuda(XQ_OP, impl, ctx.module_context.platforms)
    fn = functools.partial(fl._xhat_reference, k=k, fused=fused)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _lower_xq_cuda(ctx, *args, k, fused, impl):
    m = ctx.avals_in[0].shape[0]
    supported = nvfp4_quant.check_shape(m, k)
    kernel = None
    if supported[0] and impl != "ref":
        try:
            kernel = nvfp4_quant.build(m, k, fused, out="xhat")
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(XQ_OP, impl, supported):
        fn = functools.partial(fl._xhat_reference, k=k, fused=fused)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return _dispatch.lower_ptx(ctx, *args, backend_config=kernel.backend_config())


mlir.register_lowering(_xq_p, _lower_xq_reference)
mlir.register_lowering(_xq_p, _lower_xq_cuda, platform="cuda")


def xhat_input(
    x: jax.Array, params: dict, norm: jax.Array, *, layer: Any, eps: float, impl: str = "auto"
) -> tuple[jax.Array, jax.Array]:
    """The tensor-core GEMM's input for `fused_linear(x, params, prologue="rmsnorm",
    norm=norm)`: (x_hat float16 [M, K] in the GEMM's K order, global scale float32 [M]), the
    bytes of the quantizer kernel's x_hat form (`rejax.ops.linear.gemm_x_operand` of
    quantize_activation(rms_norm(x))); on CUDA that kernel. `pre_attention_block(..., xq=)`
    reads it.

    Args:
        x: [M, K] bf16. params: W4A4 params (stacked with `layer`). norm: [K] or [L, K].
        layer: int32 [] (may be traced). eps: the RMSNorm epsilon. impl: as the other ops.
    """
    _dispatch.check_impl(impl)
    w = fl._w4a4_weight("xhat_input", params, layer)
    k = w.shape[1]
    if np.ndim(x) != 2 or np.shape(x)[1] != k or np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"x {np.shape(x)} {np.dtype(x.dtype)}, expected [M, {k}] bfloat16")
    stacked_norm = np.ndim(norm) == 2
    if tuple(np.shape(norm)) != ((*w.stack, k) if stacked_norm else (k,)):
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k,)} or {(*w.stack, k)}")
    fused = _fused(params, "rmsnorm", False, eps, stacked_norm, layer)
    return tuple(
        _xq_p.bind(
            x,
            _scale_operand(params),
            jnp.asarray(norm, jnp.bfloat16),
            jnp.asarray(0 if layer is None else layer, jnp.int32).reshape(()),
            k=k,
            fused=fused,
            impl=impl,
        )
    )


# ----------------------------------------------------------------------------- pre-attention


def pre_supported(
    m: int,
    shape: tuple,
    rope: rope_kernel.Shape,
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
) -> tuple[bool, str]:
    """(True, "") if `pre_attention_block`'s kernel chain serves M rows of a qkv projection of
    `shape` (n, k) feeding the rope kernel of `rope`, else (False, why): M in the GEMM's rows,
    a GEMM and quantizer shape, a qkv GEMM that splits K through partials, a rope kernel
    shape."""
    ok, why = _chain_rows(m, gemm_options)
    if not ok:
        return ok, why
    n, k = shape
    for ok, why in (nvfp4_gemm.check_shape(m, n, k, gemm_options), nvfp4_quant.check_shape(m, k),
                    rope_kernel.check_shape(rope)):  # fmt: skip
        if not ok:
            return False, why
    if not nvfp4_gemm.plan(m, n, k, cbuild.device_sms(), gemm_options).partials:
        return False, f"M={m}: the qkv GEMM does not split K (nothing to fuse)"
    return True, ""


def _pre_reference(x, xg, nw, wp, ws, wg, layer, *rope_ops, shape, fused, rope, theta, **_: Any):
    """fused_linear's reference (RMSNorm, the qkv projection), then rope_cache's."""
    n, k = shape
    no_res = jnp.zeros((1, 1), jnp.bfloat16)
    qkv = fl._reference(x, xg, nw, no_res, wp, ws, wg, layer, n=n, k=k, fused=fused)
    qn, kn, positions, index, inv_freq, kc, vc = rope_ops
    return rope_ref._reference(qkv, qn, kn, layer, positions, index, inv_freq, kc, vc,
                               shape=rope, theta=theta)  # fmt: skip


def _pre_abstract(x, *ops, rope, **_: Any):
    kc, vc = ops[-2], ops[-1]
    q = jax.core.ShapedArray((rope.batch, rope.heads, rope.head_dim), jnp.bfloat16)
    return q, jax.core.ShapedArray(kc.shape, kc.dtype), jax.core.ShapedArray(vc.shape, vc.dtype)


_pre_p = fl._jitted_primitive("rejax_nvfp4_pre_attention_block", _pre_abstract)


def _lower_pre_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(PRE_OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_pre_reference, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _pre_chain(x, xg, nw, wp, ws, wg, layer, *rope_ops, shape, fused, quant, gemm, rope_kern):
    pro = dataclasses.replace(fused, residual=False)
    xh, xgr = fl._quant_xhat_p.bind(x, xg, nw, layer, k=shape[1], fused=pro, kernel=quant)
    return _pre_xq_chain(xh, xgr, wp, ws, wg, layer, *rope_ops, gemm=gemm, rope_kern=rope_kern)


def _pre_kernels(m, shape, gw_rows, rope, gemm_options) -> dict:
    """The qkv GEMM and the rope kernel that reads its partials (KernelError if one fails)."""
    n, k = shape
    gemm = nvfp4_gemm.build(m, n, k, options=gemm_options, gw_rows=gw_rows)
    p = gemm.plan
    fin = nvfp4_quant.FinishIn(splitk=p.splitk, w_shift=p.w_shift, gw_rows=p.gw_rows)
    return {"gemm": gemm, "rope_kern": rope_kernel.build(rope, finish=fin)}


def _lower_pre_cuda(ctx, *args, shape, fused, gw_rows, rope, theta, impl, gemm_options):
    m = ctx.avals_in[0].shape[0]
    supported = pre_supported(m, shape, rope, gemm_options)
    kernels = None
    if supported[0] and impl != "ref":
        try:
            pro = dataclasses.replace(fused, residual=False)
            quant = nvfp4_quant.build(m, shape[1], pro, out="xhat")
            kernels = {"quant": quant, **_pre_kernels(m, shape, gw_rows, rope, gemm_options)}
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(PRE_OP, impl, supported):
        fn = functools.partial(_pre_reference, shape=shape, fused=fused, rope=rope, theta=theta)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    fn = functools.partial(_pre_chain, shape=shape, fused=fused, **kernels)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


mlir.register_lowering(_pre_p, _lower_pre_reference)
mlir.register_lowering(_pre_p, _lower_pre_cuda, platform="cuda")


def pre_attention_block(
    x: jax.Array,
    qkv_proj: dict,
    q_norm: jax.Array | None,
    k_norm: jax.Array | None,
    positions: jax.Array,
    index: jax.Array,
    k_cache: jax.Array,
    v_cache: jax.Array,
    *,
    norm: jax.Array,
    layer: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
    eps: float,
    theta: float,
    impl: str = "auto",
    gemm_options: nvfp4_gemm.GemmOptions = nvfp4_gemm.DEFAULT_OPTIONS,
    xq: tuple[jax.Array, jax.Array] | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The decode step before the attention for one new token a row: qkv =
    fused_linear(x, qkv_proj, prologue="rmsnorm", norm=norm), then `rope_cache` (q/k norms,
    RoPE, the cache write), with the qkv GEMM's split-K finish inside the rope kernel on CUDA
    (one launch fewer; Config.gemm_chain "fused").

    Args:
        x: [B, D] bf16, the residual stream (one token per row).
        qkv_proj: W4A4 params of the fused q/k/v projection (`fused_linear.fusable`), stacked
            [L, ...] with `layer`.
        q_norm, k_norm, positions, index, k_cache, v_cache, heads, kv_heads, head_dim, theta:
            as `rejax.ops.rope_cache.rope_cache` (a bf16 cache, updated in place on CUDA).
        norm: the input RMSNorm weight, [D] or stacked [L, D].
        layer: int32 [] layer of the stacks.
        eps: the epsilon of the input RMSNorm and of the q/k norms (the decoder's one
            rms_norm_eps).
        impl: "auto", "ref" or "cuda" ("cuda" fails where the chain does not serve,
            `pre_supported` says why).
        gemm_options: the qkv GEMM's choices (`min_m` .. `max_m` are the rows the chain takes).
        xq: the qkv GEMM's input already quantized, (x_hat f16 [B, D], global scale f32 [B])
            as `xhat_input(x, qkv_proj, norm)` gives it (the previous layer's
            `post_attention_block(..., next_qkv=)` writes it): then x and norm are not read
            (x may be None) and no quantizer runs. Only where the chain applies
            (`pre_supported`); its reference is the qkv product of those values
            (`rejax.nvfp4.nvfp4_matmul_prescaled`, bitwise the product of the codes).

    Returns:
        (q [B, N, H], k_cache, v_cache). Where the chain does not apply, `fused_linear` then
        `rope_cache`, the decoder's "split" path.
    """
    if xq is not None:
        return _pre_from_xhat(xq, qkv_proj, q_norm, k_norm, positions, index, k_cache, v_cache,
                              layer=layer, heads=heads, kv_heads=kv_heads, head_dim=head_dim,
                              eps=eps, theta=theta, impl=impl, gemm_options=gemm_options)  # fmt: skip
    _dispatch.check_impl(impl)
    w = fl._w4a4_weight("pre_attention_block's qkv_proj", qkv_proj, layer)
    n, k = w.shape
    if n != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(
            f"qkv_proj N={n}, expected (heads + 2 kv_heads) x head_dim = "
            f"{(heads + 2 * kv_heads) * head_dim}"
        )
    if np.ndim(x) != 2 or np.shape(x)[1] != k or np.dtype(x.dtype) != np.dtype(jnp.bfloat16):
        raise ValueError(f"x {np.shape(x)} {np.dtype(x.dtype)}, expected [B, {k}] bfloat16")
    stacked_norm = np.ndim(norm) == 2
    if tuple(np.shape(norm)) != ((*w.stack, k) if stacked_norm else (k,)):
        raise ValueError(f"norm.shape={np.shape(norm)}, expected {(k,)} or {(*w.stack, k)}")
    if not isinstance(gemm_options, nvfp4_gemm.GemmOptions):
        got = type(gemm_options).__name__
        raise ValueError(f"gemm_options must be a GemmOptions, got {got}")  # noqa: TRY004
    b = int(np.shape(x)[0])

    def composed():
        qkv = fl.fused_linear(x, qkv_proj, layer=layer, prologue="rmsnorm", norm=norm, eps=eps,
                              impl=impl, kernels="two", gemm_options=gemm_options)  # fmt: skip
        return rope_ref.rope_cache(
            qkv, q_norm, k_norm, layer, positions, index, k_cache, v_cache, heads=heads,
            kv_heads=kv_heads, head_dim=head_dim, eps=eps, theta=theta, impl=impl,
        )  # fmt: skip

    rope = rope_ref.rope_shape(b, q_norm, k_norm, positions, index, k_cache, v_cache,
                               heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip
    ok, why = pre_supported(b, (n, k), rope, gemm_options)
    bf16 = all(np.dtype(c.dtype) == np.dtype(jnp.bfloat16) for c in (k_cache, v_cache))
    if ok and not bf16:
        ok, why = False, f"cache dtype {np.dtype(k_cache.dtype)} (the rope kernel takes bfloat16)"
    if impl == "ref" or not ok:
        if impl == "cuda" and not ok:
            raise ValueError(f"pre_attention_block(impl='cuda'): {why}")
        return composed()
    fused = _fused(qkv_proj, "rmsnorm", False, eps, stacked_norm, layer)
    return tuple(
        _pre_p.bind(
            x,
            _scale_operand(qkv_proj),
            jnp.asarray(norm, jnp.bfloat16),
            *_weight_operands(w),
            jnp.asarray(layer, jnp.int32).reshape(()),
            *_rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache, head_dim, theta),
            shape=(n, k),
            fused=fused,
            gw_rows=w.per_row,
            rope=rope,
            theta=float(theta),
            impl=impl,
            gemm_options=gemm_options,
        )
    )


def _pre_xq_reference(xh, xg, wp, ws, wg, layer, *rope_ops, shape, rope, theta, **_: Any):
    """The qkv product of the given x_hat (`nvfp4_matmul_prescaled`), then rope_cache's
    reference."""
    n, k = shape
    w = linear_ops._weight(wp, ws, wg, layer, n, k)
    qkv = nvfp4.nvfp4_matmul_prescaled(linear_ops.gemm_x_values(xh), xg, w)
    qn, kn, positions, index, inv_freq, kc, vc = rope_ops
    return rope_ref._reference(qkv, qn, kn, layer, positions, index, inv_freq, kc, vc,
                               shape=rope, theta=theta)  # fmt: skip


_pre_xq_p = fl._jitted_primitive("rejax_nvfp4_pre_attention_block_xhat", _pre_abstract)


def _lower_pre_xq_reference(ctx, *args, **params):
    _dispatch.refuse_off_cuda(PRE_OP, params["impl"], ctx.module_context.platforms)
    fn = functools.partial(_pre_xq_reference, **params)
    return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)


def _pre_xq_chain(xh, xg, wp, ws, wg, layer, *rope_ops, gemm, rope_kern):
    part = _partials(gemm, xh, xg, wp, ws, wg, layer)
    qn, kn, positions, index, inv_freq, kc, vc = rope_ops
    s = rope_kern.shape
    outs = (
        jax.ShapeDtypeStruct((s.batch, s.heads, s.head_dim), jnp.bfloat16),
        jax.ShapeDtypeStruct(kc.shape, kc.dtype),
        jax.ShapeDtypeStruct(vc.shape, vc.dtype),
    )
    ops = (part, xg, wg, qn, kn, layer, positions, index, inv_freq, kc, vc)
    return _dispatch.ptx_call(rope_kern.backend_config(), outs, *ops, aliases=rope_kern.aliases)


def _lower_pre_xq_cuda(ctx, *args, shape, gw_rows, rope, theta, impl, gemm_options):
    m = ctx.avals_in[0].shape[0]
    supported = pre_supported(m, shape, rope, gemm_options)
    kernels = None
    if supported[0] and impl != "ref":
        try:
            kernels = _pre_kernels(m, shape, gw_rows, rope, gemm_options)
        except nvfp4_gemv.KernelError as err:
            supported = (False, f"kernel build failed: {err}")
    if not _dispatch.use_kernel(PRE_OP, impl, supported):
        fn = functools.partial(_pre_xq_reference, shape=shape, rope=rope, theta=theta)
        return mlir.lower_fun(fn, multiple_results=True)(ctx, *args)
    return mlir.lower_fun(functools.partial(_pre_xq_chain, **kernels), multiple_results=True)(
        ctx, *args
    )


mlir.register_lowering(_pre_xq_p, _lower_pre_xq_reference)
mlir.register_lowering(_pre_xq_p, _lower_pre_xq_cuda, platform="cuda")


def _pre_from_xhat(xq, qkv_proj, q_norm, k_norm, positions, index, k_cache, v_cache, *, layer,
                   heads, kv_heads, head_dim, eps, theta, impl, gemm_options):  # fmt: skip
    """`pre_attention_block` on a given x_hat (see its `xq`)."""
    _dispatch.check_impl(impl)
    w = fl._w4a4_weight("pre_attention_block's qkv_proj", qkv_proj, layer)
    n, k = w.shape
    xh, xg = xq
    b = int(np.shape(xh)[0]) if np.ndim(xh) == 2 else -1
    if (tuple(np.shape(xh)) != (b, k) or np.dtype(xh.dtype) != np.dtype(jnp.float16)
            or tuple(np.shape(xg)) != (b,) or np.dtype(xg.dtype) != np.dtype(jnp.float32)):  # fmt: skip
        raise ValueError(
            f"xq ({np.shape(xh)} {np.dtype(xh.dtype)}, {np.shape(xg)} {np.dtype(xg.dtype)}): "
            f"expected (float16 [B, {k}], float32 [B])"
        )
    if n != (heads + 2 * kv_heads) * head_dim:
        raise ValueError(
            f"qkv_proj N={n}, expected (heads + 2 kv_heads) x head_dim = "
            f"{(heads + 2 * kv_heads) * head_dim}"
        )
    rope = rope_ref.rope_shape(b, q_norm, k_norm, positions, index, k_cache, v_cache,
                               heads=heads, kv_heads=kv_heads, head_dim=head_dim, eps=eps)  # fmt: skip
    if impl == "cuda":
        ok, why = pre_supported(b, (n, k), rope, gemm_options)
        if not ok:
            raise ValueError(f"pre_attention_block(impl='cuda', xq=...): {why}")
    return tuple(
        _pre_xq_p.bind(
            xh,
            xg,
            *_weight_operands(w),
            jnp.asarray(layer, jnp.int32).reshape(()),
            *_rope_operands(q_norm, k_norm, positions, index, k_cache, v_cache, head_dim, theta),
            shape=(n, k),
            gw_rows=w.per_row,
            rope=rope,
            theta=float(theta),
            impl=impl,
            gemm_options=gemm_options,
        )
    )
