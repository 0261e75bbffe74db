"""`rejax.ops.dot_block` on the CPU: `mlp_dot` and `post_attention_dot` are the two or three
fused linears they replace, bitwise; their CUDA lowering on the dot path hands each float32 dot
sum to the next quantizer kernel (the "xhat_bf16" finish-quantizer, `FinishIn.dot`), with no
bf16 output in between but the residual stream, and elsewhere lowers as the fused linears; the
decoder takes them under Config.gemm_dot_finish; the finish-quantizer's dot form builds without
local memory; bad values are refused."""

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
from rejax.ops.dot_block import (
    dot_block_supported,
    mlp_dot,
    mlp_dot_supported,
    post_attention_dot,
)
from rejax.ops.fused_linear import fused_linear

D, F, K_O = 256, 512, 768
ROWS = 2100  # above the wgmma range (gemm_wgmma_max_m 2048): the dot path


def _mlp(scales: bool, stacked: bool = True):
    """gate_up [2F, D] (gate and up shards with their own global scales: one per row), down
    [D, F] and o_proj [D, K_O] W4A4 params (static input scales or dynamic ones) and the norm
    weight, stacked over 2 layers or not: (gate_up, down, norm, o_proj)."""
    shards = jax.random.normal(jax.random.key(1), (2, 2, F, D), jnp.float32) * 0.05
    shards = shards * jnp.asarray([1.0, 0.3])[None, :, None, None]
    gate_up = [nvfp4.concat_rows([nvfp4.quantize_weight(s) for s in pair]) for pair in shards]
    gu = {"weight": nvfp4.stack(gate_up), "input_scale": jnp.asarray([0.03, 0.021], jnp.float32)}
    assert gu["weight"].per_row
    dn = stacked_linear(D, F, [0.0047, 0.0033], seed=2)
    op = stacked_linear(D, K_O, [0.013, 0.0091], seed=5)
    norm = jax.random.normal(jax.random.key(3), (2, D), jnp.float32).astype(jnp.bfloat16)
    if not stacked:
        gu, dn, op = (
            {"weight": nvfp4.take(p["weight"], 1), "input_scale": p["input_scale"][1]}
            for p in (gu, dn, op)
        )
        norm = norm[1]
    if not scales:
        gu, dn, op = ({"weight": p["weight"]} for p in (gu, dn, op))
    return gu, dn, norm, op


def _two(gu, dn, norm, op=None, **kw):
    """The fused linears the ops replace, on (out, x, layer); without `op` out is unused."""

    def f(out, x, layer):
        if op is not None:
            x = fused_linear(out, op, layer=layer, residual=x, **kw)
        h = fused_linear(x, gu, layer=layer, prologue="rmsnorm", norm=norm, eps=1e-5, **kw)
        return fused_linear(h, dn, layer=layer, prologue="swiglu", residual=x, **kw)

    return f


def _one(gu, dn, norm, op=None, **kw):
    if op is None:
        return lambda out, x, layer: mlp_dot(x, gu, dn, layer=layer, norm=norm, eps=1e-5, **kw)
    return lambda out, x, layer: post_attention_dot(
        out, x, op, gu, dn, layer=layer, norm=norm, eps=1e-5, **kw
    )


def _inputs(m: int, seed: int = 4):
    out = (jax.random.normal(jax.random.key(seed), (m, K_O)) * 3).astype(jnp.bfloat16)
    x = (jax.random.normal(jax.random.key(seed + 1), (m, D)) * 2).astype(jnp.bfloat16)
    return out, x


@pytest.mark.parametrize("with_o", [False, True])
@pytest.mark.parametrize(("scales", "stacked"), [(True, True), (False, True), (True, False)])
def test_ops_are_the_fused_linears_bitwise(scales, stacked, with_o):
    """Off CUDA each op lowers as its fused linears (o_proj with the residual, gate_up with
    the RMSNorm, down with the SwiGLU and the residual): the same bits, with static or dynamic
    scales, stacked at a traced layer or not; and both equal the unfused functions'
    composition jitted as one program (op by op, outside jit, XLA's CPU fusions may keep a bf16
    intermediate in float32, so eager bits are not the reference)."""
    gu, dn, norm, op = _mlp(scales, stacked)
    op = op if with_o else None
    out, x = _inputs(64)
    kw = {"kernels": "two"}
    layer = jnp.int32(1) if stacked else None
    a = jax.jit(lambda o, x: _two(gu, dn, norm, op, **kw)(o, x, layer))(out, x)
    b = jax.jit(lambda o, x: _one(gu, dn, norm, op, **kw)(o, x, layer))(out, x)
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
    # the composition of the unfused functions
    from rejax import layers

    def matmul(h, p):
        w = nvfp4.take(p["weight"], 1) if stacked else p["weight"]
        s = p.get("input_scale")
        s = None if s is None else (s[1] if stacked else s)
        return nvfp4.nvfp4_matmul(h.astype(jnp.bfloat16), w, act="w4a4", input_scale=s)

    def unfused(out, x):
        if with_o:
            x = x + matmul(out, op)
        h = layers.rms_norm(x, norm[1] if stacked else norm, 1e-5)
        g = matmul(h, gu)
        return x + matmul(layers.swiglu(g[:, :F], g[:, F:]), dn)

    want = jax.jit(unfused)(out, x)
    np.testing.assert_array_equal(np.asarray(b).view(np.uint16), np.asarray(want).view(np.uint16))


def _cuda_text(fn, *args) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def _names(text: str) -> list[str]:
    return re.findall(r"name = \\22(\w+)\\22", text)


def _feeds_a_custom_call(text: str, rows: int, cols: int) -> bool:
    """Whether a dot's float32 [rows, cols] result is the first operand of the next PTX call."""
    dot = re.search(rf"(%\S+) = stablehlo.dot_general .*-> tensor<{rows}x{cols}xf32>", text)
    if not dot:
        return False
    call = re.search(r"stablehlo.custom_call @__gpu\$xla\.gpu\.ptx\((%\S+),", text[dot.end() :])
    return bool(call) and call.group(1) == dot.group(1)


@pytest.mark.parametrize("with_o", [False, True])
def test_cuda_lowering_hands_each_float32_sum_to_the_next_quantizer(with_o, quant_defines):
    """On the dot path (2100 rows) the CUDA lowering is: the first linear's quantizer
    ("xhat_bf16"), the dequantizer and one dot whose float32 result the finish-quantizer reads
    ("xhat_bf16", FIN_SPLITK 1, FIN_W_SHIFT 14: for gate_up's input with the RMSNorm, the
    residual and h stored, one CTA a row keeping the row in shared memory; for down's with the
    SwiGLU and gate_up's per-row weight scales), and so on to down's dot: no bf16 [M, 2F]
    tensor, where the fused linears have one (and a quantizer a linear). At the wgmma GEMM's
    rows (300) and the GEMV's (8) the op lowers as the fused linears do."""
    seen = quant_defines
    gu, dn, norm, op = _mlp(True)
    op = op if with_o else None
    layer = jnp.int32(1)
    q, dq, fin = nvfp4_quant.ENTRY, "nvfp4_dequant_bf16", nvfp4_quant.FIN_ENTRY
    args = (*_inputs(ROWS), layer)
    one = _cuda_text(_one(gu, dn, norm, op, kernels="two"), *args)
    two = _cuda_text(_two(gu, dn, norm, op, kernels="two"), *args)
    assert _names(one) == [q, dq] + [fin, dq] * (2 if with_o else 1), _names(one)
    assert _names(two) == [q, dq] * (3 if with_o else 2), _names(two)
    assert f"tensor<{ROWS}x{2 * F}xbf16>" in two
    assert f"tensor<{ROWS}x{2 * F}xbf16>" not in one
    assert _feeds_a_custom_call(one, ROWS, 2 * F)
    assert _feeds_a_custom_call(one, ROWS, D) == with_o
    fins = [d for d in seen if d.get("FIN_SPLITK")]
    assert len(fins) == (2 if with_o else 1), fins
    got = [(d["XHAT_OUT"], d["FIN_SPLITK"], d["FIN_W_SHIFT"], d["FIN_GW_ROWS"], d["PRO"],
            d["K_IN"], d["FIN_RES"], d["FIN_STORE_Y"], d.get("FIN_CACHE", 0),
            d["NTHREADS"]) for d in fins]  # fmt: skip
    want = [(3, 1, 14, 1, 2, F, 0, 0, 0, min(128, F // 8))]
    if with_o:  # o_proj's weight scale is one a matrix
        want.insert(0, (3, 1, 14, 0, 1, D, 1, 1, 1, min(128, D // 8)))
    assert got == want, got
    # the wgmma range and the GEMV's rows: the fused linears' lowering
    for m in (300, 8):
        args = (*_inputs(m), layer)
        shapes = ((D, K_O),) if with_o else ()
        assert not dot_block_supported(m, (*shapes, (2 * F, D), (D, F)))[0]
        got = _cuda_text(_one(gu, dn, norm, op, kernels="two"), *args)
        assert _names(got) == _names(_cuda_text(_two(gu, dn, norm, op, kernels="two"), *args))


def test_dot_block_supported_says_why():
    ok = nvfp4_gemm.GemmOptions()
    mlp = ((2 * F, D), (D, F))
    assert mlp_dot_supported(ROWS, *mlp, ok) == (True, "")
    assert dot_block_supported(ROWS, ((D, K_O), *mlp), ok) == (True, "")
    for m, opts, shapes, why in (
        (300, ok, mlp, "not the dot path"),
        (ROWS, nvfp4_gemm.GemmOptions(dot_x="fused"), mlp, "dot_x='fused'"),
        (ROWS, nvfp4_gemm.GemmOptions(dot_dequant="xla"), mlp, "dot_dequant"),
        (ROWS, ok, ((2 * F, D), (D, F + 16)), "expected [2F, D] and [D, F]"),
        (ROWS, ok, ((D + 16, K_O), *mlp), "expected [D, K], [2F, D] and [D, F]"),
        (ROWS, ok, ((2 * 264, D), (D, 264)), "K=264"),
        (ROWS, ok, ((D, 264), *mlp), "K=264"),
    ):
        got, msg = dot_block_supported(m, shapes, opts)
        assert not got and why in msg, (m, msg)


def test_errors_name_the_value():
    gu, dn, norm, op = _mlp(True)
    out, x = (a[:8] for a in _inputs(8))
    layer = jnp.int32(0)
    with pytest.raises(ValueError, match=r"x \(8, 128\) bfloat16, expected \[M, 256\]"):
        mlp_dot(x[:, :128], gu, dn, layer=layer, norm=norm)
    with pytest.raises(ValueError, match="float32, expected"):
        mlp_dot(x.astype(jnp.float32), gu, dn, layer=layer, norm=norm)
    with pytest.raises(ValueError, match=r"gate_up_proj \(1024, 256\), down_proj \(1024, 256\)"):
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
    with pytest.raises(ValueError, match=r"out \(8, 256\) bfloat16, expected \[M, 768\]"):
        post_attention_dot(x, x, op, gu, dn, layer=layer, norm=norm)
    with pytest.raises(ValueError, match="out has 8 rows and x 4"):
        post_attention_dot(out, x[:4], op, gu, dn, layer=layer, norm=norm)
    narrow = stacked_linear(128, K_O, [0.01, 0.01], seed=6)  # D = 128: not gate_up's 256
    with pytest.raises(ValueError, match=r"o_proj \(128, 768\), gate_up_proj \(1024, 256\)"):
        post_attention_dot(out, x[:, :128], narrow, gu, dn, layer=layer, norm=norm)
    assert post_attention_dot(out[:0], x[:0], op, gu, dn, layer=layer, norm=norm).shape == (0, D)


def test_finish_in_dot_builds_and_refuses_bad_values(quant_defines):
    """`FinishIn.dot` (splitk 1, w_shift 14): the "xhat_bf16" finish-quantizer builds for sm_90
    without a stack frame at Qwen3-8B's shapes and 4096 rows (one CTA a row): down's SwiGLU
    input (F = 12288; static stacked and dynamic scales, per-row and single weight scales) and
    gate_up's RMSNorm input with the residual and y stored (D = 4096, the row kept in shared
    memory); w_shift 14 needs splitk 1, other w_shifts are refused by name, and the codes and
    tiles forms take no finish."""
    seen = quant_defines
    source = cbuild.read_source(nvfp4_gemv.SOURCE)
    fin = nvfp4_quant.FinishIn.dot(gw_rows=True)
    assert (fin.splitk, fin.w_shift, fin.gw_rows) == (1, nvfp4_quant.DOT_W_SHIFT, True)
    o_fin = dataclasses.replace(nvfp4_quant.FinishIn.dot(False), residual=True, store_y=True)
    for prologue, k, dynamic, finish in (
        ("swiglu", 12288, False, fin),
        ("swiglu", 12288, True, nvfp4_quant.FinishIn.dot(False)),
        ("rmsnorm", 4096, False, o_fin),
        ("rmsnorm", 4096, True, o_fin),
    ):
        fused = nvfp4_gemv.Fused(prologue=prologue, dynamic=dynamic, scale_stacked=not dynamic,
                                 norm_stacked=prologue == "rmsnorm")  # fmt: skip
        kern = nvfp4_quant.build(4096, k, fused, arch="compute_90", out="xhat_bf16",
                                 finish=finish)  # fmt: skip
        assert kern.entry == nvfp4_quant.FIN_ENTRY and kern.grid == (4096, 1, 1)
        assert kern.out_shapes == (((4096, k), "bfloat16"), ((4096,), "float32"))
        assert cbuild.ptx_entries(kern.ptx) == {nvfp4_quant.FIN_ENTRY: 10}
        assert (seen[-1]["XHAT_OUT"], seen[-1]["FIN_W_SHIFT"]) == (3, 14)
        assert seen[-1].get("FIN_CACHE", 0) == (prologue == "rmsnorm")
        log = cbuild.ptxas_log(source, seen[-1], "sm_90", name=nvfp4_gemv.SOURCE)
        assert "0 bytes spill stores" in log and "0 bytes stack frame" in log, (prologue, log)
    with pytest.raises(nvfp4_gemv.KernelError, match="takes splitk=1, got 2"):
        nvfp4_quant.FinishIn(splitk=2, w_shift=14)
    with pytest.raises(nvfp4_gemv.KernelError, match="w_shift=9, expected an int in 0..7 or 14"):
        nvfp4_quant.FinishIn(splitk=1, w_shift=9)
    for out in ("codes", "xhat_tiles"):
        with pytest.raises(nvfp4_gemv.KernelError, match=f"'xhat_bf16', got '{out}'"):
            nvfp4_quant.build(64, 4096, nvfp4_gemv.PLAIN, arch="compute_90", out=out,
                              finish=fin)  # fmt: skip


def _tiny(cfg_kw=None):
    from rejax import params as rparams

    cfg = rconfig.Config(
        quant="nvfp4", hidden_size=D, intermediate_size=F, head_dim=64, num_heads=4,
        num_kv_heads=2, num_layers=2, **(cfg_kw or {}),
    )  # fmt: skip
    return cfg, rparams.init_params(cfg, 0, jnp.bfloat16)


def test_decoder_gemm_dot_finish(tmp_path, monkeypatch):
    """Config.gemm_dot_finish (static input scales): a 2100-token prefill's layer lowers for
    CUDA with the finish-quantizer in place of down's quantizer ("swiglu") and of gate_up's too
    ("block"), and no bf16 gate_up output; on the CPU the logits equal "split"'s bitwise; a
    decode step (the GEMV's rows) lowers as with "split"; a bad value is refused by name."""
    from _lowering import layer_launches, per_linear_scales

    from rejax import decode as rdecode
    from rejax.cache import init_cache

    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    assert rconfig.Config().gemm_dot_finish == "block"
    base, params = _tiny()
    base = dataclasses.replace(base, gemm_dot_finish="split")
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

    off = run(base, "cuda").as_text()
    assert nvfp4_quant.FIN_ENTRY not in off and f"tensor<{tokens}x{2 * F}xbf16>" in off
    want = np.asarray(run(base)[0], np.float32)
    for finish, count in (("swiglu", 1), ("block", 2)):
        on = dataclasses.replace(base, gemm_dot_finish=finish)
        text = run(on, "cuda").as_text()
        assert _names(text).count(nvfp4_quant.FIN_ENTRY) == count, (finish, _names(text))
        assert f"tensor<{tokens}x{2 * F}xbf16>" not in text
        np.testing.assert_array_equal(np.asarray(run(on)[0], np.float32), want, err_msg=finish)
        # decode steps: the GEMV's rows, where the ops do not apply
        assert layer_launches(on)[0] == layer_launches(base)[0]
    with pytest.raises(ValueError, match="unknown gemm_dot_finish 'fused'"):
        rconfig.Config(gemm_dot_finish="fused")
