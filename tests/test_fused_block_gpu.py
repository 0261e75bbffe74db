"""GPU tests of the finish-quantizer `nvfp4_finish_quantize` (cuda_ops/nvfp4_quant.py's
`FinishIn`) and of `rejax.ops.fused_block.post_attention_block` (marker `gpu`).

* The kernel's y, x_hat and global scales equal, bit for bit, the two launches it replaces on
  the same float32 partials: the GEMM's split-K finish kernel (`nvfp4_gemm_finish`, with the
  residual where it has one) and then the quantizer kernel's x_hat form on its y. Qwen3-8B's
  o_proj -> gate_up (RMSNorm, residual, y stored; K = 4096) and gate_up -> down (SwiGLU over
  2 x 12288 partial columns) at M = 8, 16, 32, 64 with 2-8 splits, static stacked and dynamic
  scales, per-row weight scales, a zero row and saturating blocks, layer 1 of a stack of 2,
  one CTA per row or the quantizer's chunks.
  Outputs launched into NaN-poisoned buffers: every byte the kernel owns is written.
* The block on the GPU equals the same linears' composition on the GPU (three `fused_linear`
  calls, the split path's launches) bit for bit at the Qwen3-8B shapes, 8-64 rows.
* `pre_attention_block` (the qkv GEMM's finish inside the rope kernel) equals the split path's
  launches (quantizer, GEMM, finish, rope kernel) bit for bit: q and both caches.
* With next_qkv, down's finish and the next layer's qkv quantizer in one launch equal the
  quantizer kernel on the block's output at layer + 1, and the pre block on that x_hat equals
  it on the output.
* The decoder with Config.gemm_chain "fused" or "swiglu_rope" gives "split"'s logits bit for
  bit (2 layers of the Qwen3-8B shapes, random weights, batch 16 and 32: every chain, the x_hat
  handed from layer to layer included).
* With `norm_cluster` (Config.gemm_chain "cluster") the RMSNorm finish-quantizers run a row's
  CTAs as a thread-block cluster: the same bytes (block, next-layer input, decoder logits).
* `test_sanitizer_subset` is the small case `compute-sanitizer` runs (memcheck, racecheck;
  experiments/gemm_device_run.sh's `chain` phase).

GEMM letters: M rows, N out features, K in features.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_logits, per_linear_scales

from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import config as rconfig
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl
from rejax.ops.fused_block import post_attention_block
from rejax.params import init_params

pytestmark = pytest.mark.gpu

D, F = 4096, 12288  # Qwen3-8B hidden and intermediate sizes


def _partials(s, m, n, seed, zero_row=True):
    """float32 partials [s, M, N] of magnitudes a K split leaves (a zero row, a row of large
    values that saturates E4M3 block scales at a small static scale)."""
    p = jax.random.normal(jax.random.key(seed), (s, m, n), jnp.float32) * 40.0
    if zero_row:
        p = p.at[:, 0].set(0.0)
    return p.at[:, m - 1, 64:96].set(3e5)


def _two_launches(part, xgp, res, wg, xg, nw, layer, *, gemm, quant):
    """The finish kernel's y, then the quantizer's (x_hat, global scale) on it."""
    m = part.shape[1]
    y = jax.ShapeDtypeStruct((m, gemm.plan.n), jnp.bfloat16)
    ops = (part, xgp, *([res] if gemm.plan.residual else []), wg, layer)
    y = _dispatch.ptx_call(gemm.backend_config(nvfp4_gemm.FINISH_ENTRY), y, *ops)
    outs = (
        jax.ShapeDtypeStruct((m, quant.k), jnp.float16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    xh, xgr = _dispatch.ptx_call(quant.backend_config(), outs, y, xg, nw, layer)
    return y, xh, xgr


def _fused(args, kern, width):
    """The finish-quantizer launched directly (torch views of the operands) into NaN-poisoned
    outputs: (y, x_hat, global scale) as uint16 / uint16 / float32 arrays; every byte the
    kernel owns must be written."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("torch has no CUDA device")
    ins = [torch.from_dlpack(jax.block_until_ready(a)) for a in args]
    m = args[0].shape[1]
    dev = ins[0].device
    outs = [
        torch.full((m, width) if kern.finish.store_y else (1,), float("nan"),
                   dtype=torch.bfloat16, device=dev),
        torch.full((m, kern.k), float("nan"), dtype=torch.float16, device=dev),
        torch.full((m,), float("nan"), dtype=torch.float32, device=dev),
    ]  # fmt: skip
    kern.launch(torch.cuda.current_stream().cuda_stream, [t.data_ptr() for t in ins + outs])
    torch.cuda.synchronize()
    y, xh, xg = (t.cpu() for t in outs)
    return (y.view(torch.int16).numpy().view(np.uint16),
            xh.view(torch.int16).numpy().view(np.uint16), xg.numpy())  # fmt: skip


CASES = [
    # (producer N, next K, prologue, residual / y stored)
    (D, D, "rmsnorm", True),
    (2 * F, F, "swiglu", False),
]


@pytest.mark.parametrize(("n", "k", "prologue", "residual"), CASES)
@pytest.mark.parametrize("scales", ["stacked", "dynamic", "rows"])
def test_finish_quantize_equals_finish_then_quantizer(n, k, prologue, residual, scales):
    dynamic = scales == "dynamic"
    gw_rows = scales == "rows"
    fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, norm_stacked=True,
                             scale_stacked=not dynamic)  # fmt: skip
    layer = jnp.int32(1)
    nw = (1 + 0.1 * jax.random.normal(jax.random.key(3), (2, k))).astype(jnp.bfloat16)
    xg = jnp.asarray([0.05, 1e-4 if scales == "stacked" else 0.02], jnp.float32)
    wshape = (2, n) if gw_rows else (2,)
    wg = jax.random.uniform(jax.random.key(4), wshape, jnp.float32, 1e-4, 4e-4)
    for m, splitk in ((8, 8), (16, 4), (32, 2), (64, 5)):
        options = nvfp4_gemm.GemmOptions(splitk=splitk)
        gemm = nvfp4_gemm.build(m, n, 4096, options=options, gw_rows=gw_rows, residual=residual)
        assert gemm.plan.partials and gemm.plan.splitk == splitk
        quant = nvfp4_quant.build(m, k, fused, out="xhat")
        # one CTA per row at M = 32 (the block's default for RMSNorm); for RMSNorm at M = 8 and
        # 64 a cluster of 8 / 4 CTAs a row (norm_cluster); else the quantizer's chunking; the
        # quantizer's threads either way
        cluster = prologue != "swiglu" and m in (8, 64)
        chunk = k if m == 32 else (k // (8 if m == 8 else 4) if cluster else None)
        fin = nvfp4_quant.FinishIn(splitk=splitk, w_shift=gemm.plan.w_shift, gw_rows=gw_rows,
                                   residual=residual, store_y=residual,
                                   cluster=cluster)  # fmt: skip
        kern = nvfp4_quant.build(m, k, fused, out="xhat", finish=fin, chunk=chunk,
                                 threads=quant.threads)  # fmt: skip
        part = _partials(splitk, m, n, seed=m + n)
        xgp = jax.random.uniform(jax.random.key(m), (m,), jnp.float32, 5e-3, 2e-2)
        res = (jax.random.normal(jax.random.key(m + 1), (m, n)) * 0.5).astype(jnp.bfloat16)
        res = res.at[0].set(0) if residual else jnp.zeros((1, 1), jnp.bfloat16)
        args = (part, xgp, res, wg, xg, nw, layer)
        two = jax.jit(functools.partial(_two_launches, gemm=gemm, quant=quant))
        y, xh, xgr = (np.asarray(a) for a in two(*args))
        fy, fxh, fxg = _fused(args, kern, n)
        what = f"M={m} splits={splitk} N={n} K={k} {prologue} scales={scales} cluster={cluster}"
        np.testing.assert_array_equal(fxh, xh.view(np.uint16), err_msg=what)
        np.testing.assert_array_equal(fxg, xgr, err_msg=what)
        if residual:
            np.testing.assert_array_equal(fy, y.view(np.uint16), err_msg=what)
        assert np.isfinite(xh.astype(np.float32)).all() and np.abs(xh).max() > 0, what


def _linear(n, k, scale, seed):
    """A stack of 2 random NVFP4 matrices (made on the device) with a static input scale [2]."""
    key = jax.random.key(seed)
    packed = jax.random.randint(key, (2, n, k // 2), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = jax.random.randint(jax.random.fold_in(key, 1), (2, n, k // 16), 0x20, 0x40)
    scales = jax.lax.bitcast_convert_type(scales.astype(jnp.uint8), jnp.float8_e4m3fn)
    w = nvfp4.Nvfp4Tensor(packed, scales, jnp.full((2,), 2e-4, jnp.float32), (n, k))
    return {"weight": w, "input_scale": jnp.asarray(scale, jnp.float32)}


@pytest.mark.parametrize(("m", "chain_norm", "cluster"), [
    (8, True, False), (16, True, False), (32, True, False), (64, True, False),
    (32, False, False), (64, False, False),
    (8, True, True), (16, True, True), (64, True, True),
])  # fmt: skip
def test_block_equals_the_composition_on_the_gpu(m, chain_norm, cluster):
    """The chain's launches (finish-quantizers where a GEMM splits K) against the split path's
    launches of the same linears, bitwise (h is the same bf16 stream, so are the codes)."""
    o = _linear(D, D, [0.02, 0.03], 1)
    g = _linear(2 * F, D, [0.05, 0.04], 2)
    d = _linear(D, F, [0.01, 0.02], 3)
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(4), (2, D))).astype(jnp.bfloat16)
    out = jax.random.normal(jax.random.key(m), (m, D), jnp.bfloat16)
    x = (jax.random.normal(jax.random.key(m + 1), (m, D)) * 3).astype(jnp.bfloat16)

    def composed(out, x, li):
        common = {"layer": li, "kernels": "two", "residual_epilogue": True}
        h = fl.fused_linear(out, o, residual=x, **common)
        common.pop("residual_epilogue")
        gu = fl.fused_linear(h, g, prologue="rmsnorm", norm=norm, eps=1e-6, **common)
        return fl.fused_linear(gu, d, prologue="swiglu", residual=h, residual_epilogue=True,
                               **common)  # fmt: skip

    run = jax.jit(lambda out, x, li: post_attention_block(out, x, o, g, d, norm=norm, layer=li,
                                                          chain_norm=chain_norm,
                                                          norm_cluster=cluster))  # fmt: skip
    lowered = run.trace(out, x, jnp.int32(1)).lower().as_text()
    assert "nvfp4_finish_quantize" in lowered
    got = np.asarray(run(out, x, jnp.int32(1)))
    want = np.asarray(jax.jit(composed)(out, x, jnp.int32(1)))
    np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16), err_msg=f"M={m}")
    assert np.isfinite(want.astype(np.float32)).all()


@pytest.mark.parametrize(
    ("batch", "chain"), [(16, "fused"), (32, "fused"), (32, "swiglu_rope"), (16, "cluster")]
)
def test_decoder_gemm_chain_fused_logits_equal_split(batch, chain):
    """Two decode steps of a 2-layer Qwen3-8B-shaped NVFP4 decoder (random weights, static
    input scales): gemm_chain "fused" (or "swiglu_rope") and "split" give the same logits bit
    for bit."""
    cfg = dataclasses.replace(rconfig.PRESETS["qwen3-8b"], num_layers=2, vocab_size=1024,
                              quant="nvfp4", gemm_chain="split")  # fmt: skip
    params = per_linear_scales(init_params(cfg, 0, jnp.bfloat16))
    want = decode_logits(cfg, params, steps=2, b=batch)
    fused = dataclasses.replace(params, cfg=dataclasses.replace(cfg, gemm_chain=chain))
    got = decode_logits(fused.cfg, fused, steps=2, b=batch)
    np.testing.assert_array_equal(got, want)
    assert np.isfinite(want).all()


def test_sanitizer_subset():
    """One small finish-quantizer launch of each kind through XLA (a cluster of 4 CTAs a row
    among them), against the two launches (for compute-sanitizer)."""
    for (n, k, prologue, residual), cluster in ((CASES[0], False), (CASES[1], False),
                                                (CASES[0], True)):  # fmt: skip
        fused = nvfp4_gemv.Fused(prologue=prologue, norm_stacked=True, scale_stacked=True)
        m, splitk = 16, 4
        gemm = nvfp4_gemm.build(m, n, 4096, options=nvfp4_gemm.GemmOptions(splitk=splitk),
                                residual=residual)  # fmt: skip
        fin = nvfp4_quant.FinishIn(splitk=splitk, residual=residual, store_y=residual,
                                   cluster=cluster)  # fmt: skip
        kern = nvfp4_quant.build(m, k, fused, out="xhat", finish=fin,
                                 chunk=k // 4 if cluster else None)  # fmt: skip
        quant = nvfp4_quant.build(m, k, fused, out="xhat")
        res = jnp.ones((m, n) if residual else (1, 1), jnp.bfloat16)
        args = (_partials(splitk, m, n, 0), jnp.full((m,), 0.01, jnp.float32), res,
                jnp.full((2,), 2e-4, jnp.float32), jnp.asarray([0.05, 0.02], jnp.float32),
                jnp.ones((2, k), jnp.bfloat16), jnp.int32(1))  # fmt: skip
        outs = (
            jax.ShapeDtypeStruct((m, n) if residual else (1,), jnp.bfloat16),
            jax.ShapeDtypeStruct((m, k), jnp.float16),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        )
        a = jax.jit(functools.partial(_dispatch.ptx_call, kern.backend_config(), outs))(*args)
        b = jax.jit(functools.partial(_two_launches, gemm=gemm, quant=quant))(*args)
        np.testing.assert_array_equal(np.asarray(a[1]).view(np.uint16),
                                      np.asarray(b[1]).view(np.uint16))  # fmt: skip


@pytest.mark.parametrize("m", [8, 16, 64])
@pytest.mark.parametrize("rows_index", [False, True])
def test_pre_block_equals_fused_linear_then_rope_cache_on_the_gpu(m, rows_index):
    """The qkv GEMM's finish inside the rope kernel against the split path's launches (quantizer,
    GEMM, finish, rope kernel) at the Qwen3-8B shapes: q and both caches bit for bit, one slot
    for every row or one per row."""
    from rejax.ops.fused_block import pre_attention_block
    from rejax.ops.rope_cache import rope_cache

    heads, kv, hd = 32, 8, 128
    qkv = _linear((heads + 2 * kv) * hd, D, [0.02, 0.03], 5)
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(6), (2, D))).astype(jnp.bfloat16)
    qn = (1 + 0.1 * jax.random.normal(jax.random.key(7), (2, hd))).astype(jnp.bfloat16)
    kn = (1 + 0.1 * jax.random.normal(jax.random.key(8), (2, hd))).astype(jnp.bfloat16)
    x = (jax.random.normal(jax.random.key(m), (m, D)) * 3).astype(jnp.bfloat16)
    cache = jax.random.normal(jax.random.key(9), (2, m, 40, kv, hd), jnp.bfloat16)
    positions = jnp.arange(m, dtype=jnp.int32) + 17
    index = jnp.arange(m, dtype=jnp.int32) % 7 if rows_index else jnp.int32(5)
    kw = {"heads": heads, "kv_heads": kv, "head_dim": hd, "eps": 1e-6, "theta": 1e6}

    def chain(x, kc, vc, li):
        return pre_attention_block(x, qkv, qn, kn, positions, index, kc, vc, norm=norm,
                                   layer=li, **kw)  # fmt: skip

    def split(x, kc, vc, li):
        y = fl.fused_linear(x, qkv, layer=li, prologue="rmsnorm", norm=norm, eps=1e-6,
                            kernels="two")  # fmt: skip
        return rope_cache(y, qn, kn, li, positions, index, kc, vc, **kw)

    run = jax.jit(chain)
    assert "qk_norm_rope_cache" in run.trace(x, cache, cache, jnp.int32(1)).lower().as_text()
    got = [np.asarray(a) for a in run(x, cache, cache + 1, jnp.int32(1))]
    want = [np.asarray(a) for a in jax.jit(split)(x, cache, cache + 1, jnp.int32(1))]
    for g, w, name in zip(got, want, ("q", "k_cache", "v_cache"), strict=True):
        np.testing.assert_array_equal(g.view(np.uint16), w.view(np.uint16), err_msg=f"{name} M={m}")
    assert not np.array_equal(got[1], np.asarray(cache))


@pytest.mark.parametrize(("m", "cluster"), [(16, False), (64, False), (32, True)])
def test_block_next_equals_the_quantizer_of_its_output_on_the_gpu(m, cluster):
    """down_proj's finish with the next layer's qkv quantizer in one launch against
    xhat_input (the quantizer kernel) of the block's own output at layer + 1, bitwise; and
    pre_attention_block on that x_hat equals it on the output."""
    from rejax.ops.fused_block import pre_attention_block, xhat_input

    o = _linear(D, D, [0.02, 0.03], 1)
    g = _linear(2 * F, D, [0.05, 0.04], 2)
    d = _linear(D, F, [0.01, 0.02], 3)
    qkv = _linear(6144, D, [0.02, 0.03], 5)
    norm = (1 + 0.1 * jax.random.normal(jax.random.key(4), (2, D))).astype(jnp.bfloat16)
    inorm = (1 + 0.1 * jax.random.normal(jax.random.key(6), (2, D))).astype(jnp.bfloat16)
    out = jax.random.normal(jax.random.key(m), (m, D), jnp.bfloat16)
    x = (jax.random.normal(jax.random.key(m + 1), (m, D)) * 3).astype(jnp.bfloat16)
    run = jax.jit(lambda out, x: post_attention_block(
        out, x, o, g, d, norm=norm, layer=jnp.int32(0), next_qkv=qkv, next_norm=inorm,
        norm_cluster=cluster))  # fmt: skip
    y, (xh, xg) = run(out, x)
    assert "nvfp4_finish_quantize" in run.trace(out, x).lower().as_text()
    want = jax.jit(lambda y: xhat_input(y, qkv, inorm, layer=jnp.int32(1), eps=1e-6))(y)
    np.testing.assert_array_equal(
        np.asarray(xh).view(np.uint16), np.asarray(want[0]).view(np.uint16)
    )
    np.testing.assert_array_equal(np.asarray(xg), np.asarray(want[1]))
    qn = (1 + 0.1 * jax.random.normal(jax.random.key(7), (2, 128))).astype(jnp.bfloat16)
    cache = jax.random.normal(jax.random.key(9), (2, m, 40, 8, 128), jnp.bfloat16)
    pos = jnp.arange(m, dtype=jnp.int32) + 3
    kw = {"heads": 32, "kv_heads": 8, "head_dim": 128, "eps": 1e-6, "theta": 1e6,
          "norm": inorm, "layer": jnp.int32(1)}  # fmt: skip
    a = jax.jit(lambda y, c: pre_attention_block(y, qkv, qn, qn, pos, jnp.int32(4), c, c, **kw))(
        y, cache
    )
    b = jax.jit(lambda xh, xg, c: pre_attention_block(
        None, qkv, qn, qn, pos, jnp.int32(4), c, c, xq=(xh, xg), **kw))(xh, xg, cache)  # fmt: skip
    for u, v in zip(a, b, strict=True):
        np.testing.assert_array_equal(np.asarray(u).view(np.uint16), np.asarray(v).view(np.uint16))
