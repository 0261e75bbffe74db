"""o_proj writing gate_up's NVFP4 input (Config.o_proj_output="nvfp4",
`rejax.ops.fused_linear.linear_norm_out`) and gate_up on given codes
(`linear_swiglu_from_codes`) without a GPU: off CUDA each is bitwise the composition it
replaces, and so is the decoder with them; lowered for CUDA each is one launch where its kernel
applies and the composition elsewhere, and a decoder layer is 7 launches with every "nvfp4"
output under "flash-mma"; the NORM_OUT build compiles without local memory and leaves the other
builds alone; bad arguments fail with the value named. The kernel's bytes are checked on the
GPU (tests/test_fused_linear_gpu.py, tests/test_decode_attention_cuda_gpu.py)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_logits, layer_launches, per_linear_scales, stacked_linear

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemm, nvfp4_gemv
from rejax import layers, nvfp4
from rejax import params as rparams
from rejax.config import Config
from rejax.ops.fused_linear import (
    fused_linear_swiglu,
    linear_from_codes,
    linear_norm_out,
    linear_swiglu_from_codes,
    norm_out_supported,
)
from rejax.params import init_params

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


def _codes(x, g):
    q = nvfp4.quantize_activation(x, jnp.float32(g))
    xs = jax.lax.bitcast_convert_type(q.scales, jnp.uint8)
    return q.packed, xs, jnp.broadcast_to(jnp.asarray(q.global_scale, jnp.float32), (x.shape[0],))


@pytest.mark.parametrize("stacked_norm", [False, True])
@pytest.mark.parametrize("scale", [np.float32(3e-3), np.array([2e-3, 1e-7], np.float32)])
def test_norm_out_is_the_quantizer_of_the_residual_output(scale, stacked_norm):
    """Off CUDA, bitwise: y = linear_from_codes(..., residual) and the codes, block scales and
    global scale of quantize_activation(rms_norm(y, norm, eps), g), g the scalar or the layer's
    entry (1e-7 saturates the block scales), at layer 0 and 1."""
    params = stacked_linear(256, 512, [2e-3, 4e-3])
    x = jax.random.normal(jax.random.key(2), (3, 512), jnp.bfloat16)
    res = jax.random.normal(jax.random.key(3), (3, 256), jnp.bfloat16)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(4), (2, 256), jnp.bfloat16)
    norm = norm if stacked_norm else norm[1]
    run = jax.jit(
        lambda xp, xs, xg, li: linear_norm_out(
            xp, xs, xg, params, residual=res, norm=norm, next_scale=scale, layer=li, eps=1e-5
        )
    )
    for layer in (0, 1):
        li = jnp.int32(layer)
        codes = _codes(x, params["input_scale"][layer])
        y, (np_, ns, ng) = run(*codes, li)
        g = scale if scale.ndim == 0 else scale[layer]
        nw = norm[layer] if stacked_norm else norm

        @jax.jit
        def composed(codes, li, nw, g):  # one program, as the decoder's "bf16" path runs it
            y = linear_from_codes(*codes, params, layer=li, residual=res)
            return y, nvfp4.quantize_activation(layers.rms_norm(y, nw, 1e-5), g)

        want_y, want = composed(codes, li, nw, jnp.float32(g))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
        ws = np.asarray(jax.lax.bitcast_convert_type(want.scales, jnp.uint8))
        np.testing.assert_array_equal(np.asarray(np_), np.asarray(want.packed))
        np.testing.assert_array_equal(np.asarray(ns), ws)
        np.testing.assert_array_equal(np.asarray(ng), np.full(3, g, np.float32))
        assert np.asarray(np_).any()
        if scale.ndim:
            assert (ws == 0x7E).all() == (layer == 1)  # 448: saturated at g = 1e-7 only


def test_norm_out_errors_name_the_value():
    params = stacked_linear(256, 512, [2e-3, 4e-3])
    xp, xs, xg = _codes(jnp.zeros((3, 512), jnp.bfloat16), 1.0)
    res = jnp.zeros((3, 256), jnp.bfloat16)
    norm = jnp.ones((256,), jnp.bfloat16)

    def call(**kw):
        args = {"xp": xp, "xs": xs, "xg": xg, "params": params, "residual": res, "norm": norm,
                "next_scale": np.float32(0.01), "layer": 0, **kw}  # fmt: skip
        return linear_norm_out(**args)

    with pytest.raises(ValueError, match=r"xp \(3, 255\) uint8, expected \(3, 256\)"):
        call(xp=xp[:, :255])
    with pytest.raises(ValueError, match=r"residual \(3, 255\)"):
        call(residual=res[:, :255])
    with pytest.raises(ValueError, match=r"norm.shape=\(255,\)"):
        call(norm=norm[:255])
    with pytest.raises(ValueError, match=r"norm.shape=\(3, 256\)"):
        call(norm=jnp.ones((3, 256), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"next_scale shape \(3,\)"):
        call(next_scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match="next_scale=0.0: expected finite and > 0"):
        call(next_scale=np.float32(0))
    with pytest.raises(ValueError, match="next_scale=nan"):
        call(next_scale=np.array([1.0, np.nan], np.float32))
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        call(layer=None)
    with pytest.raises(ValueError, match="W4A4 NVFP4 params"):
        call(params={"weight": jnp.zeros((256, 512))})
    with pytest.raises(ValueError, match="impl"):
        call(impl="fast")


def test_norm_out_supported_says_why():
    assert norm_out_supported(1, 4096, 4096) == (True, "")
    assert norm_out_supported(7, 4096, 4096)[0]
    ok, why = norm_out_supported(8, 4096, 4096)
    assert not ok and "take the GEMM" in why
    ok, why = norm_out_supported(1, 4096, 100)
    assert not ok and "K=100" in why
    ok, why = norm_out_supported(1, 4112, 4096)  # a GEMV shape, not the quantizer kernel's K
    assert not ok and "next linear's input N=4112" in why
    go = nvfp4_gemm.GemmOptions(min_m=9)
    assert norm_out_supported(8, 4096, 4096, go)[0]


def test_norm_out_lowers_to_one_launch_where_it_applies():
    """Lowered for CUDA: one NORM_OUT GEMV at M = 1 (the streaming GEMV) and M = 3 (the
    persistent one); from gemm_min_m rows on the composition (the GEMM, then the quantizer
    kernel up to its 8 rows, XLA's quantizer ops above); impl="ref" no kernel; impl="cuda"
    refuses the GEMM's rows."""
    params = stacked_linear(1024, 512, [2e-3, 4e-3])
    norm = jnp.ones((2, 1024), jnp.bfloat16)

    def names(m, impl="auto"):
        fn = jax.jit(
            lambda xp, xs, xg, res: linear_norm_out(
                xp, xs, xg, params, residual=res, norm=norm, next_scale=np.float32(0.01),
                layer=1, impl=impl,
            )
        )  # fmt: skip
        args = (
            jax.ShapeDtypeStruct((m, 256), jnp.uint8),
            jax.ShapeDtypeStruct((m, 32), jnp.uint8),
            jax.ShapeDtypeStruct((m,), jnp.float32),
            jax.ShapeDtypeStruct((m, 1024), jnp.bfloat16),
        )
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"name = \\22(\w+)\\22", text)

    assert names(1) == ["nvfp4_gemv_w4a4"]
    assert names(3) == ["nvfp4_gemv_w4a4"]
    assert names(3, "ref") == []
    assert names(8) == ["nvfp4_gemm_w4a4", "nvfp4_quantize_bf16"]
    assert names(16) == ["nvfp4_gemm_w4a4"]  # the quantizer kernel's rows end at 8: XLA's ops
    with pytest.raises(ValueError, match="take the GEMM"):
        names(16, "cuda")


@needs_nvrtc
@pytest.mark.parametrize("m", [1, 3, 8])
def test_norm_out_builds_and_leaves_the_plain_build_alone(m, tmp_path, monkeypatch):
    """The NORM_OUT GEMV (Qwen3-8B o_proj, 4096 x 4096, residual) compiles for sm_90 without
    local memory: 10 operands (the norm weight and the next scale after layer) and 4 results;
    the plain residual build's defines (so its cache key and PTX) carry no NORM_OUT; bad
    requests are refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    kw = {"arch": "compute_90", "num_sms": 132}
    plain = nvfp4_gemv.build("w4a4", m, 4096, 4096, residual=True, **kw)
    assert "NORM_OUT" not in plain.plan.defines()
    for no in (nvfp4_gemv.NormOut(), nvfp4_gemv.NormOut(True, True, 1e-5, 128)):
        kern = nvfp4_gemv.build("w4a4", m, 4096, 4096, residual=True, norm_out=no, **kw)
        p = kern.plan
        d = p.defines()
        assert (d["NORM_OUT"], d["NWN_STACK"], d["XGN_STACK"]) == (1, int(no.norm_stacked),
                                                                    int(no.scale_stacked))  # fmt: skip
        assert d["NORM_EPS"] == f"{no.eps!r}f" and d["NORM_THREADS"] == 128
        assert (p.n_inputs, p.n_outputs) == (10, 4)
        assert cbuild.ptx_entries(kern.ptx) == {"nvfp4_gemv_w4a4": 14}
        assert ".local" not in kern.ptx and "output_indices = [10, 11, 12, 13]" in (
            kern.backend_config()
        )
        with pytest.raises(nvfp4_gemv.KernelError, match="PTX call only"):
            kern.launch(0, [0] * 14)
        assert plain.ptx != kern.ptx
    for bad, word in (
        ({"norm_out": nvfp4_gemv.NormOut()}, "residual=True"),
        ({"norm_out": "yes", "residual": True}, "NormOut or None"),
        ({"norm_out": nvfp4_gemv.NormOut(threads=48), "residual": True}, "threads=48"),
    ):
        with pytest.raises(nvfp4_gemv.KernelError, match=word):
            nvfp4_gemv.build("w4a4", m, 4096, 4096, **bad, **kw)
    with pytest.raises(nvfp4_gemv.KernelError, match="N=4112 must be a multiple of 256"):
        nvfp4_gemv.build("w4a4", m, 4112, 4096, residual=True, norm_out=nvfp4_gemv.NormOut(), **kw)
    (got,) = nvfp4_gemv.prebuild(
        [{"act": "w4a4", "m": m, "n": 4096, "k": 4096, "residual": True,
          "norm_out": nvfp4_gemv.NormOut()}], **kw,
    )  # fmt: skip
    assert got is nvfp4_gemv.build("w4a4", m, 4096, 4096, residual=True,
                                   norm_out=nvfp4_gemv.NormOut(), **kw)  # fmt: skip


@pytest.mark.parametrize("down_scale", [np.float32(3e-4), np.array([1e-3, 1e-6], np.float32)])
def test_swiglu_from_codes_is_fused_linear_swiglu_of_the_quantized_x(down_scale):
    """Off CUDA, bitwise: linear_swiglu_from_codes of the codes of rms_norm(x) (what
    linear_norm_out hands gate_up) equals fused_linear_swiglu(x) at layer 0 and 1."""
    params = stacked_linear(64, 256, [2e-3, 4e-3])
    x = jax.random.normal(jax.random.key(2), (3, 256), jnp.bfloat16)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (2, 256), jnp.bfloat16)
    for layer in (0, 1):
        li = jnp.int32(layer)

        @jax.jit
        def both(x, li, layer=layer):
            h = layers.rms_norm(x, norm[layer], 1e-6)
            codes = _codes(h, params["input_scale"][layer])
            got = linear_swiglu_from_codes(*codes, params, down_scale, layer=li)
            want = fused_linear_swiglu(x, params, down_scale, layer=li, norm=norm, eps=1e-6)
            return got, want

        got, want = both(x, li)
        for a, b in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        assert np.asarray(got[0]).any()


def test_swiglu_from_codes_lowers_to_one_launch_where_the_kernel_serves():
    """Lowered for CUDA: the SWIGLU_OUT GEMV alone at M = 3 (the persistent GEMV's rows for
    this small layer); at M = 2 (streamed) the plain GEMV then the quantizer (SwiGLU); no
    kernel with impl="ref"; errors name the value."""
    params = stacked_linear(1024, 256, [2e-3, 4e-3])

    def names(m, impl="auto"):
        fn = jax.jit(
            lambda xp, xs, xg: linear_swiglu_from_codes(
                xp, xs, xg, params, np.float32(0.01), layer=1, impl=impl
            )
        )
        args = (
            jax.ShapeDtypeStruct((m, 128), jnp.uint8),
            jax.ShapeDtypeStruct((m, 16), jnp.uint8),
            jax.ShapeDtypeStruct((m,), jnp.float32),
        )
        text = fn.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"name = \\22(\w+)\\22", text)

    assert names(3) == ["nvfp4_gemv_w4a4"]
    assert names(2) == ["nvfp4_gemv_w4a4", "nvfp4_quantize_bf16"]
    assert names(3, "ref") == []
    with pytest.raises(ValueError, match="streaming kernel"):
        names(2, "cuda")
    xp, xs, xg = _codes(jnp.zeros((3, 256), jnp.bfloat16), 1.0)
    with pytest.raises(ValueError, match=r"xs \(3, 15\) uint8, expected \(3, 16\)"):
        linear_swiglu_from_codes(xp, xs[:, :15], xg, params, np.float32(1), layer=0)
    with pytest.raises(ValueError, match="down_scale=-1.0"):
        linear_swiglu_from_codes(xp, xs, xg, params, np.float32(-1), layer=0)
    with pytest.raises(ValueError, match="N=48 must be 2F"):
        linear_swiglu_from_codes(xp, xs, xg, stacked_linear(48, 256, [1, 1]), np.float32(1),
                                 layer=0)  # fmt: skip


ALL_NVFP4 = {"attention_output": "nvfp4", "gate_up_output": "nvfp4", "o_proj_output": "nvfp4"}


def test_decoder_o_proj_output_nvfp4_is_bitwise_bf16_off_cuda():
    """Decode steps' logits with o_proj_output "nvfp4" (with attention_output "nvfp4", where it
    applies, and with gate_up_output "nvfp4" too) equal "bf16"'s bit for bit off CUDA, with
    static input scales on every linear."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash-mma", gate_up_output="bf16")  # fmt: skip
    params = per_linear_scales(init_params(cfg, 3, jnp.bfloat16))
    base = decode_logits(cfg, params, steps=5, b=3)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    for change in ({"attention_output": "nvfp4", "o_proj_output": "nvfp4"}, ALL_NVFP4):
        got = decode_logits(dataclasses.replace(cfg, **change), params, steps=5, b=3)
        np.testing.assert_array_equal(got, base)


def test_cuda_lowering_drops_the_gate_up_quantizer():
    """Lowered for CUDA under "flash-mma" at batch 3: attention_output and o_proj_output "nvfp4"
    take two quantizer launches out of the scanned layer (10 -> 8), and with gate_up_output
    "nvfp4" too three (7: the qkv quantizer, 4 GEMVs, rope_cache, attention); o_proj's GEMV
    returns y and gate_up's codes, scales and global scale."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash-mma", gate_up_output="bf16")  # fmt: skip
    base, _ = layer_launches(cfg, 3)
    assert len(base) == 10 and base.count("nvfp4_quantize_bf16") == 4
    two = dataclasses.replace(cfg, attention_output="nvfp4", o_proj_output="nvfp4")
    names, body = layer_launches(two, 3)
    assert len(names) == 8 and names.count("nvfp4_quantize_bf16") == 2, names
    gemvs = [line for line in body.splitlines() if "nvfp4_gemv_w4a4" in line and "->" in line]
    four = [g.rsplit("->", 1)[-1] for g in gemvs if g.rsplit("->", 1)[-1].count("tensor<") == 4]
    assert len(four) == 1, gemvs  # o_proj: y [3, 256] bf16, then gate_up's input
    assert "tensor<3x256xbf16>, tensor<3x128xui8>, tensor<3x16xui8>, tensor<3xf32>" in four[0]
    names, body = layer_launches(dataclasses.replace(cfg, **ALL_NVFP4), 3)
    assert len(names) == 7 and names.count("nvfp4_quantize_bf16") == 1, names
    assert body.count("stablehlo.custom_call") == 7


@pytest.mark.parametrize(
    "change,batch",
    [
        ({"attention": "live"}, 3),  # the Pallas attention writes bf16: o_proj quantizes it
        ({"residual_fusion": "unfused"}, 3),  # the residual add is XLA's, after the GEMV
        ({"gemm_min_m": 3}, 3),  # the GEMM's rows
        ({"weight_prefetch": "next"}, 3),  # NORM_OUT takes no prefetch operands
    ],
)
def test_o_proj_output_nvfp4_applies_only_where_it_can(change, batch):
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash-mma", attention_output="nvfp4")  # fmt: skip
    cfg = dataclasses.replace(cfg, **change)
    plain, _ = layer_launches(cfg, batch)
    names, _ = layer_launches(dataclasses.replace(cfg, o_proj_output="nvfp4"), batch)
    assert names == plain


def test_o_proj_output_nvfp4_needs_a_static_gate_up_scale():
    """gate_up without an input scale (per-row dynamic): o_proj's GEMV writes y only."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash-mma", attention_output="nvfp4")  # fmt: skip
    params = per_linear_scales(init_params(cfg, 0, jnp.bfloat16))

    def drop(path, p):
        return {k: v for k, v in p.items() if k != "input_scale" or path[1] != "gate_up_proj"}

    params = dataclasses.replace(params, weights=rparams.map_linears(params.weights, drop))
    logits = decode_logits(dataclasses.replace(cfg, o_proj_output="nvfp4"), params, steps=2, b=3)
    np.testing.assert_array_equal(logits, decode_logits(cfg, params, steps=2, b=3))


def test_config_o_proj_output_validated():
    with pytest.raises(ValueError, match="unknown o_proj_output 'fp4'"):
        Config(o_proj_output="fp4")
