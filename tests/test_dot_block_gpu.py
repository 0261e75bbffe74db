"""GPU tests of `rejax.ops.dot_block` (marker `gpu`; skipped without a CUDA GPU): the "xhat_bf16"
finish-quantizer on a float32 dot sum (`FinishIn.dot`) writes the quantizer kernel's bytes of
`nvfp4.scale_x_values_sum` of that sum (plus the residual, storing it, for the RMSNorm input;
zero and saturating rows included); `mlp_dot` and `post_attention_dot` equal the fused linears'
dot path bitwise; a prefill under each Config.gemm_dot_finish gives "split"'s logits bitwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_dot_block import ROWS, _inputs, _mlp, _names, _one, _tiny, _two

from cuda_ops import nvfp4_gemv, nvfp4_quant
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(
    ("m", "k", "prologue"),
    [(64, 2048, "swiglu"), (300, 512, "swiglu"), (2100, 3072, "swiglu"), (300, 4096, "rmsnorm"),
     (64, 2048, "rmsnorm")],
)  # fmt: skip
def test_finish_dot_equals_the_quantizer_of_the_scaled_sum(m, k, prologue, dynamic):
    """The finish's values and global scales against the "xhat_bf16" quantizer kernel on
    bf16(sum * (global_w * global_x)) (+ the residual, for "rmsnorm", whose y is that input)."""
    rng = np.random.default_rng(m + k)
    cols = 2 * k if prologue == "swiglu" else k
    acc = rng.standard_normal((m, cols)).astype(np.float32) * 40
    acc[3] = 0.0  # a zero row
    acc[5, : k // 2] *= 1e4  # blocks far above the static scale's range: saturating codes
    wg = rng.uniform(1e-4, 1e-3, (2, cols)).astype(np.float32)  # per row, two layers
    xgp = rng.uniform(0.01, 0.1, (m,)).astype(np.float32)
    xg = np.asarray([0.004, 0.0031], np.float32)
    layer = jnp.int32(1)
    norm = jnp.asarray(rng.uniform(0.5, 1.5, (2, k)), jnp.bfloat16)
    res = jnp.asarray(rng.standard_normal((m, k)) * 3, jnp.bfloat16)
    rms = prologue == "rmsnorm"
    fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, scale_stacked=not dynamic,
                             norm_stacked=rms)  # fmt: skip
    fin = nvfp4_quant.FinishIn.dot(True)
    if rms:
        fin = dataclasses.replace(fin, residual=True, store_y=True)
    kern = nvfp4_quant.build(m, k, fused, out="xhat_bf16", finish=fin)
    quant = nvfp4_quant.build(m, k, fused, out="xhat_bf16")
    outs = (
        jax.ShapeDtypeStruct((m, k) if rms else (1,), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, k), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    dummy = jnp.zeros((1,), jnp.bfloat16)

    @jax.jit
    def got(acc, xgp, res, wg, xg, norm, layer):
        return _dispatch.ptx_call(kern.backend_config(), outs, acc, xgp, res if rms else dummy,
                                  wg, xg, norm if rms else dummy, layer)  # fmt: skip

    @jax.jit
    def want(acc, xgp, res, wg, xg, norm, layer):
        h = nvfp4.scale_x_values_sum(acc, xgp, wg[1])
        h = res + h if rms else h
        xv, xgr = fl._quant_xbf16_p.bind(h, xg, norm if rms else dummy, layer, k=k, fused=fused,
                                         kernel=quant)  # fmt: skip
        return h, xv, xgr

    a = got(acc, xgp, res, wg, xg, norm, layer)
    b = want(acc, xgp, res, wg, xg, norm, layer)
    if rms:
        np.testing.assert_array_equal(np.asarray(a[0]).view(np.uint16),
                                      np.asarray(b[0]).view(np.uint16))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(a[1]).view(np.uint16),
                                  np.asarray(b[1]).view(np.uint16))  # fmt: skip
    np.testing.assert_array_equal(np.asarray(a[2]), np.asarray(b[2]))
    if not rms:
        assert np.all(np.asarray(a[1])[3] == 0)


@pytest.mark.parametrize("with_o", [False, True])
@pytest.mark.parametrize(("scales", "stacked"), [(True, True), (False, True), (True, False)])
def test_ops_equal_the_fused_linears_on_the_gpu(scales, stacked, with_o):
    """At 2100 rows (the dot path) the ops' kernels give the fused linears' bits."""
    from rejax.ops.dot_block import dot_block_supported

    gu, dn, norm, op = _mlp(scales, stacked)
    shapes = (gu["weight"].shape, dn["weight"].shape)
    if with_o:
        shapes = (op["weight"].shape, *shapes)
    else:
        op = None
    assert dot_block_supported(ROWS, shapes)[0]
    out, x = _inputs(ROWS)
    layer = jnp.int32(1) if stacked else None
    one = jax.jit(lambda o, x: _one(gu, dn, norm, op, kernels="two")(o, x, layer))
    two = jax.jit(lambda o, x: _two(gu, dn, norm, op, kernels="two")(o, x, layer))
    # kernel names, not the text: the PTX inside each call names its entry many times
    names = _names(one.lower(out, x).as_text())
    assert names.count(nvfp4_quant.FIN_ENTRY) == (2 if with_o else 1), names
    a, b = np.asarray(one(out, x)), np.asarray(two(out, x))
    assert np.isfinite(a.astype(np.float32)).all()
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_decoder_gemm_dot_finish_logits_on_the_gpu():
    from _lowering import per_linear_scales

    from rejax import decode as rdecode
    from rejax.cache import init_cache

    base, params = _tiny()
    params = per_linear_scales(params)
    tokens = ROWS
    ids = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (1, tokens)),
                      jnp.int32)  # fmt: skip
    pos = jnp.arange(tokens, dtype=jnp.int32)[None]
    logits = {}
    for finish in ("split", "swiglu", "block"):
        cfg = dataclasses.replace(base, gemm_dot_finish=finish)
        p = dataclasses.replace(params, cfg=cfg)
        cache = init_cache(cfg, 1, tokens + 8, jnp.bfloat16)
        logits[finish] = np.asarray(rdecode.prefill(p, ids, pos, cache)[0], np.float32)
    assert np.isfinite(logits["split"]).all()
    for finish in ("swiglu", "block"):
        np.testing.assert_array_equal(logits[finish], logits["split"], err_msg=finish)
