"""GPU tests of `rejax.ops.mlp_dot` (marker `gpu`; skipped without a CUDA GPU): the "xhat_bf16"
finish-quantizer on a float32 dot sum (`FinishIn.dot`) writes the quantizer kernel's bytes of
`nvfp4.scale_x_values_sum` of that sum (zero and saturating rows included); the op equals the
two fused linears' dot path bitwise; a prefill under Config.gate_up_dot_out "float32" gives the
"bf16" logits bitwise.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_mlp_dot import _mlp, _one, _tiny, _two

from cuda_ops import nvfp4_gemv, nvfp4_quant
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import fused_linear as fl

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize(("m", "f"), [(64, 2048), (300, 512), (2100, 3072)])
def test_finish_dot_equals_the_quantizer_of_the_scaled_sum(m, f, dynamic):
    rng = np.random.default_rng(m + f)
    acc = rng.standard_normal((m, 2 * f)).astype(np.float32) * 40
    acc[3] = 0.0  # a zero row
    acc[5, : f // 2] *= 1e4  # blocks far above the static scale's range: saturating codes
    wg = rng.uniform(1e-4, 1e-3, (2, 2 * f)).astype(np.float32)  # per row, two layers
    xgp = rng.uniform(0.01, 0.1, (m,)).astype(np.float32)
    xg = np.asarray([0.004, 0.0031], np.float32)
    layer = jnp.int32(1)
    fused = nvfp4_gemv.Fused(prologue="swiglu", dynamic=dynamic, scale_stacked=not dynamic)
    fin = nvfp4_quant.build(m, f, fused, out="xhat_bf16", finish=nvfp4_quant.FinishIn.dot(True))
    quant = nvfp4_quant.build(m, f, fused, out="xhat_bf16")
    outs = (
        jax.ShapeDtypeStruct((1,), jnp.bfloat16),
        jax.ShapeDtypeStruct((m, f), jnp.bfloat16),
        jax.ShapeDtypeStruct((m,), jnp.float32),
    )
    dummy = jnp.zeros((1,), jnp.bfloat16)

    @jax.jit
    def got(acc, xgp, wg, xg, layer):
        return _dispatch.ptx_call(fin.backend_config(), outs, acc, xgp, dummy, wg, xg, dummy,
                                  layer)[1:]  # fmt: skip

    @jax.jit
    def want(acc, xgp, wg, xg, layer):
        h = nvfp4.scale_x_values_sum(acc, xgp, wg[1])
        return fl._quant_xbf16_p.bind(h, xg, dummy, layer, k=f, fused=fused, kernel=quant)

    a = got(acc, xgp, wg, xg, layer)
    b = want(acc, xgp, wg, xg, layer)
    np.testing.assert_array_equal(
        np.asarray(a[0]).view(np.uint16), np.asarray(b[0]).view(np.uint16)
    )
    np.testing.assert_array_equal(np.asarray(a[1]), np.asarray(b[1]))
    assert np.all(np.asarray(a[0])[3] == 0)


@pytest.mark.parametrize(("scales", "stacked"), [(True, True), (False, True), (True, False)])
def test_mlp_dot_equals_the_two_fused_linears_on_the_gpu(scales, stacked):
    """At 2100 rows (the dot path) the op's kernels give the two fused linears' bits."""
    from rejax.ops.mlp_dot import mlp_dot_supported

    gu, dn, norm = _mlp(scales, stacked)
    d = norm.shape[-1]
    assert mlp_dot_supported(2100, gu["weight"].shape, dn["weight"].shape)[0]
    x = jnp.asarray(np.random.default_rng(1).standard_normal((2100, d)) * 2, jnp.bfloat16)
    layer = jnp.int32(1) if stacked else None
    one = jax.jit(lambda x: _one(gu, dn, norm, kernels="two")(x, layer))
    two = jax.jit(lambda x: _two(gu, dn, norm, kernels="two")(x, layer))
    assert nvfp4_quant.FIN_ENTRY in one.lower(x).as_text()
    a, b = np.asarray(one(x)), np.asarray(two(x))
    assert np.isfinite(a.astype(np.float32)).all()
    np.testing.assert_array_equal(a.view(np.uint16), b.view(np.uint16))


def test_decoder_gate_up_dot_out_float32_logits_on_the_gpu():
    from _lowering import per_linear_scales

    from rejax import decode as rdecode
    from rejax.cache import init_cache

    base, params = _tiny()
    params = per_linear_scales(params)
    tokens = 2100
    ids = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (1, tokens)),
                      jnp.int32)  # fmt: skip
    pos = jnp.arange(tokens, dtype=jnp.int32)[None]
    logits = {}
    for out in ("bf16", "float32"):
        cfg = dataclasses.replace(base, gate_up_dot_out=out)
        p = dataclasses.replace(params, cfg=cfg)
        cache = init_cache(cfg, 1, tokens + 8, jnp.bfloat16)
        logits[out] = np.asarray(rdecode.prefill(p, ids, pos, cache)[0], np.float32)
    np.testing.assert_array_equal(logits["float32"], logits["bf16"])
