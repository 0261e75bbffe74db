"""`rejax.ops.mlp_dot` on the CPU: the op is the two fused linears it replaces, bitwise; its CUDA
lowering on the dot path hands gate_up's float32 dot sum to down's quantizer kernel (the
"xhat_bf16" finish-quantizer, `FinishIn.dot`), with no bf16 gate_up output, and elsewhere
lowers as the two fused linears; the decoder takes it under Config.gate_up_dot_out "float32";
the finish-quantizer's dot form builds without local memory; bad values are refused."""

from __future__ import annotations

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import stacked_linear

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm, nvfp4_gemv, nvfp4_quant
from rejax import config as rconfig
from rejax import nvfp4
from rejax.ops.fused_linear import fused_linear
from rejax.ops.mlp_dot import mlp_dot, mlp_dot_supported

D, F = 256, 512
ROWS = 2100  # above the wgmma range (gemm_wgmma_max_m 2048): the dot path


def _mlp(scales: bool, stacked: bool = True):
    """gate_up [2F, D] (gate and up shards with their own global scales: one per row), down
    [D, F] W4A4 params (static input scales or dynamic ones) and the norm weight, stacked over
    2 layers or not."""
    shards = jax.random.normal(jax.random.key(1), (2, 2, F, D), jnp.float32) * 0.05
    shards = shards * jnp.asarray([1.0, 0.3])[None, :, None, None]
    gate_up = [nvfp4.concat_rows([nvfp4.quantize_weight(s) for s in pair]) for pair in shards]
    gu = {"weight": nvfp4.stack(gate_up), "input_scale": jnp.asarray([0.03, 0.021], jnp.float32)}
    assert gu["weight"].per_row
    dn = stacked_linear(D, F, [0.0047, 0.0033], seed=2)
    norm = jax.random.normal(jax.random.key(3), (2, D), jnp.float32).astype(jnp.bfloat16)
    if not stacked:
        gu = {"weight": nvfp4.take(gu["weight"], 1), "input_scale": gu["input_scale"][1]}
        dn = {"weight": nvfp4.take(dn["weight"], 1), "input_scale": dn["input_scale"][1]}
        norm = norm[1]
    if not scales:
        gu, dn = {"weight": gu["weight"]}, {"weight": dn["weight"]}
    return gu, dn, norm


def _two(gu, dn, norm, **kw):
    def f(x, layer):
        h = fused_linear(x, gu, layer=layer, prologue="rmsnorm", norm=norm, eps=1e-5, **kw)
        return fused_linear(h, dn, layer=layer, prologue="swiglu", residual=x, **kw)

    return f


def _one(gu, dn, norm, **kw):
    return lambda x, layer: mlp_dot(x, gu, dn, layer=layer, norm=norm, eps=1e-5, **kw)


@pytest.mark.parametrize(("scales", "stacked"), [(True, True), (False, True), (True, False)])
def test_mlp_dot_is_the_two_fused_linears_bitwise(scales, stacked):
    """Off CUDA the op lowers as the two fused linears (`fused_linear` rmsnorm, then swiglu with
    the residual): the same bits, with static or dynamic scales, stacked at a traced layer or
    not; and both equal the unfused functions' composition."""
    gu, dn, norm = _mlp(scales, stacked)
    x = (jax.random.normal(jax.random.key(4), (64, D)) * 2).astype(jnp.bfloat16)
    kw = {"kernels": "two"}
    layer = jnp.int32(1) if stacked else None
    if stacked:
        a = jax.jit(_two(gu, dn, norm, **kw))(x, layer)
        b = jax.jit(_one(gu, dn, norm, **kw))(x, layer)
    else:
        a = jax.jit(lambda x: _two(gu, dn, norm, **kw)(x, None))(x)
        b = jax.jit(lambda x: _one(gu, dn, norm, **kw)(x, None))(x)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    # the composition of the unfused functions
    from rejax import layers

    def weight(p):
        return nvfp4.take(p["weight"], 1) if stacked else p["weight"]

    def scale(p):
        s = p.get("input_scale")
        return None if s is None else (s[1] if stacked else s)

    nw = norm[1] if stacked else norm
    h = layers.rms_norm(x, nw, 1e-5).astype(jnp.bfloat16)
    g = nvfp4.nvfp4_matmul(h, weight(gu), act="w4a4", input_scale=scale(gu))
    s = layers.swiglu(g[:, :F], g[:, F:]).astype(jnp.bfloat16)
    want = x + nvfp4.nvfp4_matmul(s, weight(dn), act="w4a4", input_scale=scale(dn))
    np.testing.assert_array_equal(np.asarray(b).view(np.uint16), np.asarray(want).view(np.uint16))


def _cuda_text(fn, x, layer) -> str:
    return jax.jit(fn).trace(x, layer).lower(lowering_platforms=("cuda",)).as_text()


def test_cuda_lowering_hands_the_float32_sum_to_downs_quantizer(tmp_path, monkeypatch):
    """On the dot path (2100 rows) the CUDA lowering is: gate_up's quantizer ("xhat_bf16"), the
    dequantizer, one dot with a float32 [M, 2F] result that the finish-quantizer reads (its
    "xhat_bf16" form, FIN_SPLITK 1, FIN_W_SHIFT 14, per-row weight scales), the dequantizer and
    down's dot: no bf16 [M, 2F] tensor, where the two fused linears have one (and a second
    quantizer). At the wgmma GEMM's rows (300) the op lowers as the two linears do."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    seen = []
    compile_ptx = nvfp4_quant.compile_ptx

    def recording(source, *, defines, **kw):
        seen.append(dict(defines))
        return compile_ptx(source, defines=defines, **kw)

    monkeypatch.setattr(nvfp4_quant, "compile_ptx", recording)
    nvfp4_quant._build_cached.cache_clear()
    gu, dn, norm = _mlp(True)
    layer = jnp.int32(1)
    try:
        x = jnp.zeros((ROWS, D), jnp.bfloat16)
        one = _cuda_text(_one(gu, dn, norm, kernels="two"), x, layer)
        two = _cuda_text(_two(gu, dn, norm, kernels="two"), x, layer)
        names = re.findall(r"name = \\22(\w+)\\22", one)
        assert names == [nvfp4_quant.ENTRY, "nvfp4_dequant_bf16", nvfp4_quant.FIN_ENTRY,
                         "nvfp4_dequant_bf16"], names  # fmt: skip
        assert re.findall(r"name = \\22(\w+)\\22", two) == [nvfp4_quant.ENTRY,
            "nvfp4_dequant_bf16", nvfp4_quant.ENTRY, "nvfp4_dequant_bf16"]  # fmt: skip
        assert f"tensor<{ROWS}x{2 * F}xbf16>" in two
        assert f"tensor<{ROWS}x{2 * F}xbf16>" not in one
        # the dot's float32 result is the finish-quantizer's first operand
        dot = re.search(rf"(%\S+) = stablehlo.dot_general .*-> tensor<{ROWS}x{2 * F}xf32>", one)
        assert dot, one[-2000:]
        call = re.search(r"stablehlo.custom_call @__gpu\$xla\.gpu\.ptx\((%\S+),", one[dot.end() :])
        assert call and call.group(1) == dot.group(1)
        fin = [d for d in seen if d.get("FIN_SPLITK")]
        assert len(fin) == 1, fin
        assert (fin[0]["XHAT_OUT"], fin[0]["FIN_SPLITK"], fin[0]["FIN_W_SHIFT"],
                fin[0]["FIN_GW_ROWS"], fin[0]["PRO"], fin[0]["K_IN"]) == (3, 1, 14, 1, 2, F)  # fmt: skip
        # the wgmma range and the GEMV's rows: the two linears' lowering
        for m in (300, 8):
            x = jnp.zeros((m, D), jnp.bfloat16)
            assert not mlp_dot_supported(m, (2 * F, D), (D, F))[0]
            got = _cuda_text(_one(gu, dn, norm, kernels="two"), x, layer)
            want = _cuda_text(_two(gu, dn, norm, kernels="two"), x, layer)
            assert re.findall(r"name = \\22(\w+)\\22", got) == re.findall(
                r"name = \\22(\w+)\\22", want
            ), m
    finally:
        nvfp4_quant._build_cached.cache_clear()


def test_mlp_dot_supported_says_why():
    ok = nvfp4_gemm.GemmOptions()
    assert mlp_dot_supported(ROWS, (2 * F, D), (D, F), ok) == (True, "")
    for m, opts, shapes, why in (
        (300, ok, ((2 * F, D), (D, F)), "not the dot path"),
        (ROWS, nvfp4_gemm.GemmOptions(dot_x="fused"), ((2 * F, D), (D, F)), "dot_x='fused'"),
        (ROWS, nvfp4_gemm.GemmOptions(dot_dequant="xla"), ((2 * F, D), (D, F)), "dot_dequant"),
        (ROWS, ok, ((2 * F, D), (D, F + 16)), "expected [2F, D] and [D, F]"),
        (ROWS, ok, ((2 * 264, D), (D, 264)), "K=264"),
    ):
        got, msg = mlp_dot_supported(m, *shapes, opts)
        assert not got and why in msg, (m, msg)


def test_mlp_dot_errors_name_the_value():
    gu, dn, norm = _mlp(True)
    x = jnp.zeros((8, D), jnp.bfloat16)
    layer = jnp.int32(0)
    with pytest.raises(ValueError, match=r"x \(8, 128\) bfloat16, expected \[M, 256\]"):
        mlp_dot(x[:, :128], gu, dn, layer=layer, norm=norm)
    with pytest.raises(ValueError, match="float32, expected"):
        mlp_dot(x.astype(jnp.float32), gu, dn, layer=layer, norm=norm)
    with pytest.raises(ValueError, match=r"gate_up \(1024, 256\) and down \(1024, 256\)"):
        mlp_dot(x, gu, gu, layer=layer, norm=norm)
    with pytest.raises(ValueError, match=r"norm.shape=\(3, 256\)"):
        mlp_dot(x, gu, dn, layer=layer, norm=jnp.zeros((3, D), jnp.bfloat16))
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        mlp_dot(x, gu, dn, norm=norm)
    with pytest.raises(ValueError, match="kernels='three'"):
        mlp_dot(x, gu, dn, layer=layer, norm=norm, kernels="three")
    with pytest.raises(ValueError, match="impl"):
        mlp_dot(x, gu, dn, layer=layer, norm=norm, impl="gpu")
    assert mlp_dot(x[:0], gu, dn, layer=layer, norm=norm).shape == (0, D)


def test_finish_in_dot_builds_and_refuses_bad_values(tmp_path, monkeypatch):
    """`FinishIn.dot` (splitk 1, w_shift 14): the "xhat_bf16" finish-quantizer with the SwiGLU
    prologue builds for sm_90 without a stack frame at Qwen3-8B's down_proj (F = 12288, 4096
    rows: one CTA a row; static stacked and dynamic scales; per-row and single weight scales);
    w_shift 14 needs splitk 1, other w_shifts are refused by name, and the codes and tiles
    forms take no finish."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    nvfp4_quant._build_cached.cache_clear()
    seen = []
    compile_ptx = nvfp4_quant.compile_ptx

    def recording(source, *, defines, **kw):
        seen.append(dict(defines))
        return compile_ptx(source, defines=defines, **kw)

    monkeypatch.setattr(nvfp4_quant, "compile_ptx", recording)
    source = cbuild.read_source(nvfp4_gemv.SOURCE)
    try:
        fin = nvfp4_quant.FinishIn.dot(gw_rows=True)
        assert (fin.splitk, fin.w_shift, fin.gw_rows) == (1, nvfp4_quant.DOT_W_SHIFT, True)
        for dynamic, rows in ((False, True), (True, False)):
            fused = nvfp4_gemv.Fused(prologue="swiglu", dynamic=dynamic, scale_stacked=not dynamic)
            kern = nvfp4_quant.build(4096, 12288, fused, arch="compute_90", out="xhat_bf16",
                                     finish=nvfp4_quant.FinishIn.dot(rows))  # fmt: skip
            assert kern.entry == nvfp4_quant.FIN_ENTRY and kern.grid == (4096, 1, 1)
            assert kern.out_shapes == (((4096, 12288), "bfloat16"), ((4096,), "float32"))
            assert cbuild.ptx_entries(kern.ptx) == {nvfp4_quant.FIN_ENTRY: 10}
            assert (seen[-1]["XHAT_OUT"], seen[-1]["FIN_W_SHIFT"]) == (3, 14)
            log = cbuild.ptxas_log(source, seen[-1], "sm_90", name=nvfp4_gemv.SOURCE)
            assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, log
        with pytest.raises(nvfp4_gemv.KernelError, match="takes splitk=1, got 2"):
            nvfp4_quant.FinishIn(splitk=2, w_shift=14)
        with pytest.raises(
            nvfp4_gemv.KernelError, match="w_shift=9, expected an int in 0..7 or 14"
        ):
            nvfp4_quant.FinishIn(splitk=1, w_shift=9)
        for out in ("codes", "xhat_tiles"):
            with pytest.raises(nvfp4_gemv.KernelError, match=f"'xhat_bf16', got '{out}'"):
                nvfp4_quant.build(64, 4096, nvfp4_gemv.PLAIN, arch="compute_90", out=out,
                                  finish=fin)  # fmt: skip
    finally:
        nvfp4_quant._build_cached.cache_clear()


def _tiny(cfg_kw=None):
    from rejax import params as rparams

    cfg = rconfig.Config(
        quant="nvfp4", hidden_size=D, intermediate_size=F, head_dim=64, num_heads=4,
        num_kv_heads=2, num_layers=2, **(cfg_kw or {}),
    )  # fmt: skip
    return cfg, rparams.init_params(cfg, 0, jnp.bfloat16)


def test_decoder_gate_up_dot_out_float32(tmp_path, monkeypatch):
    """Config.gate_up_dot_out "float32" (static input scales): a 2100-token prefill's layer
    lowers for CUDA with the
    finish-quantizer in place of down's quantizer (and no bf16 gate_up output); on the CPU its
    logits equal "bf16"'s bitwise; a decode step (the GEMV's rows) lowers as with "bf16"; a bad
    value is refused by name."""
    from _lowering import layer_launches, per_linear_scales

    from rejax import decode as rdecode
    from rejax.cache import init_cache

    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    assert rconfig.Config().gate_up_dot_out == "bf16"
    base, params = _tiny()
    params = per_linear_scales(params)  # static scales, a different one per linear and layer
    tokens = ROWS
    ids = jnp.asarray(np.random.default_rng(0).integers(0, base.vocab_size, (1, tokens)),
                      jnp.int32)  # fmt: skip
    pos = jnp.arange(tokens, dtype=jnp.int32)[None]

    def run(cfg, platform=None):
        p = dataclasses.replace(params, cfg=cfg)
        cache = init_cache(cfg, 1, tokens + 8, jnp.bfloat16)
        if platform:
            return rdecode.prefill.trace(p, ids, pos, cache).lower(lowering_platforms=(platform,))
        return rdecode.prefill(p, ids, pos, cache)

    on = dataclasses.replace(base, gate_up_dot_out="float32")
    text = run(on, "cuda").as_text()
    names = re.findall(r"name = \\22(\w+)\\22", text)
    assert names.count(nvfp4_quant.FIN_ENTRY) == 1, names
    assert f"tensor<{tokens}x{2 * F}xbf16>" not in text
    off = run(base, "cuda").as_text()
    assert nvfp4_quant.FIN_ENTRY not in off and f"tensor<{tokens}x{2 * F}xbf16>" in off
    a, b = run(on)[0], run(base)[0]
    np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
    # decode steps: the GEMV's rows, where the op does not apply
    assert layer_launches(on)[0] == layer_launches(base)[0]
    with pytest.raises(ValueError, match="unknown gate_up_dot_out 'f32'"):
        rconfig.Config(gate_up_dot_out="f32")
