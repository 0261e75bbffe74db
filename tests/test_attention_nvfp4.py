"""The decode attention's NVFP4 output (Config.attention_output="nvfp4") without a GPU:
`decode_attention_nvfp4` is quantize_activation of `decode_attention`'s bf16 output, bitwise;
`linear_from_codes` is `fused_linear` of the x those codes quantize, bitwise; the decoder with
it is bitwise the "bf16" decoder off CUDA; the decode step's CUDA lowering drops o_proj's
quantizer launch (9 launches a layer) exactly where it applies; the kernel's QUANT_OUT build
compiles and leaves the other builds' PTX alone; bad arguments fail with the value named. The
kernel's bytes are checked on the GPU (tests/test_decode_attention_cuda_gpu.py)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_logits, layer_launches, per_linear_scales, stacked_linear

from cuda_ops import build as cbuild
from cuda_ops import decode_attention as flash
from rejax import nvfp4
from rejax.config import Config
from rejax.ops.decode_attention import decode_attention, decode_attention_nvfp4
from rejax.ops.fused_linear import fused_linear, linear_from_codes, takes_codes
from rejax.params import init_params

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


def _problem(b=3, s=40, n=8, kh=2, h=32, layers=2, seed=0):
    keys = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(keys[0], (b, n, h), jnp.bfloat16)
    kc = jax.random.normal(keys[1], (layers, b, s, kh, h), jnp.bfloat16)
    vc = jax.random.normal(keys[2], (layers, b, s, kh, h), jnp.bfloat16)
    live = 29
    kp = np.where(np.arange(s) < live, np.arange(s), -1)[None].repeat(b, 0).astype(np.int32)
    kp[1, :] = -1  # a row with no visible key: zeros, code 0, scale 0
    qp = np.full((b,), live - 1, np.int32)
    return q, kc, vc, jnp.asarray(qp), jnp.asarray(kp), jnp.int32(live)


@pytest.mark.parametrize("scale", [np.float32(2e-3), np.array([0.03, 1e-4], np.float32)])
def test_nvfp4_output_is_quantize_activation_of_the_bf16_output(scale):
    """Off CUDA: the bytes of quantize_activation(out.reshape(B, N*H), g) with g the scalar or
    the layer's entry of a stacked scale (1e-4 saturates most blocks' E4M3 scales), for a
    traced layer inside jit too; the row with no visible key is all code 0 and scale 0."""
    q, kc, vc, qp, kp, live = _problem()
    for layer in (0, 1):
        args = (q, kc, vc, jnp.int32(layer), qp, kp, live)
        out = decode_attention(*args)
        g = scale if scale.ndim == 0 else scale[layer]
        want = nvfp4.quantize_activation(out.reshape(3, -1), jnp.float32(g))
        run = jax.jit(lambda *a: decode_attention_nvfp4(*a, scale))
        xp, xs, xg = run(*args)
        np.testing.assert_array_equal(np.asarray(xp), np.asarray(want.packed))
        ws = np.asarray(jax.lax.bitcast_convert_type(want.scales, jnp.uint8))
        np.testing.assert_array_equal(np.asarray(xs), ws)
        np.testing.assert_array_equal(np.asarray(xg), np.full(3, g, np.float32))
        assert not np.asarray(xp)[1].any() and not np.asarray(xs)[1].any()
        if scale.ndim:
            # 448 (0x7E): the E4M3 scale saturates at layer 1 (g = 1e-4) only
            assert ((ws[0] == 0x7E).sum() > ws.shape[1] // 2) == (layer == 1)


def test_nvfp4_output_errors_name_the_value():
    q, kc, vc, qp, kp, live = _problem()
    args = (q, kc, vc, jnp.int32(0), qp, kp, live)
    with pytest.raises(ValueError, match=r"input_scale must be .* \[L\]=\(2,\), got \(3,\)"):
        decode_attention_nvfp4(*args, jnp.ones((3,), jnp.float32))
    with pytest.raises(ValueError, match=r"input_scale=0.0: expected finite and > 0"):
        decode_attention_nvfp4(*args, jnp.array([0.1, 0.0], jnp.float32))
    with pytest.raises(ValueError, match=r"input_scale=-1.0"):
        decode_attention_nvfp4(*args, np.float32(-1))
    with pytest.raises(ValueError, match="input_scale must be floating"):
        decode_attention_nvfp4(*args, jnp.int32(1))
    # N*H not a multiple of the 16-element block
    q2, kc2, vc2 = q[:, :1, :8], kc[..., :1, :8], vc[..., :1, :8]
    with pytest.raises(ValueError, match="N\\*H=8 must be a multiple of 16"):
        decode_attention_nvfp4(q2, kc2, vc2, jnp.int32(0), qp, kp, live, np.float32(1))


def _linear(n=64, k=256):
    return stacked_linear(n, k, [2e-3, 5e-3])


def test_linear_from_codes_is_fused_linear_of_the_quantized_x():
    """Bitwise, with and without the residual (both epilogue settings), at layer 0 and 1."""
    params = _linear()
    x = jax.random.normal(jax.random.key(2), (3, 256), jnp.bfloat16)
    res = jax.random.normal(jax.random.key(3), (3, 64), jnp.bfloat16)
    for layer in (0, 1):
        xq = nvfp4.quantize_activation(x, params["input_scale"][layer])
        codes = (
            xq.packed,
            jax.lax.bitcast_convert_type(xq.scales, jnp.uint8),
            jnp.broadcast_to(xq.global_scale, (3,)),
        )
        for residual in (None, res):
            want = fused_linear(x, params, layer=jnp.int32(layer), residual=residual)
            for epi in (False, True):
                got = linear_from_codes(*codes, params, layer=jnp.int32(layer), residual=residual,
                                        residual_epilogue=epi)  # fmt: skip
                np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    # the GEMV's rows only: below gemm_min_m (8 by default), not from it on, nor a K the GEMV
    # does not take (a multiple of 256)
    assert takes_codes(1, params) and takes_codes(7, params) and not takes_codes(8, params)
    assert not takes_codes(1, _linear(k=128)) and not takes_codes(1, {"weight": jnp.zeros((4, 4))})


def test_linear_from_codes_errors():
    params = _linear()
    xp = jnp.zeros((3, 128), jnp.uint8)
    xs = jnp.zeros((3, 16), jnp.uint8)
    xg = jnp.ones((3,), jnp.float32)
    with pytest.raises(ValueError, match=r"xp \(3, 63\) uint8, expected \(3, 128\)"):
        linear_from_codes(xp[:, :63], xs, xg, params, layer=0)
    with pytest.raises(ValueError, match=r"xs \(3, 16\) float32"):
        linear_from_codes(xp, xs.astype(jnp.float32), xg, params, layer=0)
    with pytest.raises(ValueError, match=r"xg \(2,\) float32, expected \(3,\)"):
        linear_from_codes(xp, xs, xg[:2], params, layer=0)
    with pytest.raises(ValueError, match=r"residual \(3, 65\)"):
        linear_from_codes(xp, xs, xg, params, layer=0, residual=jnp.zeros((3, 65), jnp.bfloat16))
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        linear_from_codes(xp, xs, xg, params)
    with pytest.raises(ValueError, match="W4A4 NVFP4 params"):
        linear_from_codes(xp, xs, xg, {"weight": jnp.zeros((64, 128))}, layer=0)


@pytest.mark.parametrize("attention", ["flash", "flash-mma"])
def test_decoder_nvfp4_attention_output_is_bitwise_bf16_off_cuda(attention):
    """The decode steps' logits with attention_output "nvfp4" equal "bf16"'s bit for bit (the
    same composition off CUDA), with static input scales on every linear."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention=attention)  # fmt: skip
    params = per_linear_scales(init_params(cfg, 3, jnp.bfloat16))
    base = decode_logits(cfg, params, steps=6, b=2)
    got = decode_logits(dataclasses.replace(cfg, attention_output="nvfp4"), params, steps=6, b=2)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    np.testing.assert_array_equal(got, base)


@pytest.mark.parametrize("attention", ["flash", "flash-mma"])
def test_cuda_lowering_drops_the_o_proj_quantizer(attention):
    """Lowered for CUDA, the scanned layer holds 9 launches under "nvfp4" (3 quantizers, not 4),
    the flash call takes the input scale (8 operands) and returns codes, scales and the global
    scale (5 results, its PTX with the E4M3 conversion); "bf16" keeps 10."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention=attention)  # fmt: skip
    names, _ = layer_launches(cfg)
    assert len(names) == 10 and names.count("nvfp4_quantize_bf16") == 4
    names, body = layer_launches(dataclasses.replace(cfg, attention_output="nvfp4"))
    assert len(names) == 9 and names.count("nvfp4_quantize_bf16") == 3
    assert names.count(flash.ENTRY) == 1 and names.count("nvfp4_gemv_w4a4") == 4
    call = next(line for line in body.splitlines() if "rejax_flash_decode" in line)
    result = call.rsplit("->", 1)[-1]
    # N*H = 256 outputs: 128 bytes of codes, 16 E4M3 scales
    assert result.count("tensor<") == 5 and "tensor<1x128xui8>" in result, result
    assert "tensor<1x16xui8>" in result and "tensor<1xf32>" in result
    assert call.split("(", 1)[-1].split(")", 1)[0].count("%") == 8
    assert "cvt.rn.satfinite.e4m3x2.f32" in call


@pytest.mark.parametrize(
    "change",
    [
        {"attention": "live"},  # the Pallas kernel: no NVFP4 output
        {"linear_fusion": "unfused"},  # no fused quantizer to drop
        {"linear_fusion": "mixed"},  # o_proj quantizes its own input already
        {"kv_dtype": "fp8"},  # the CUDA kernel reads bf16 caches
    ],
)
def test_nvfp4_attention_output_applies_only_where_it_can(change):
    """Where attention_output "nvfp4" does not apply, the lowering is "bf16"'s, unchanged."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, **{"attention": "flash", **change})  # fmt: skip
    plain, _ = layer_launches(cfg)
    names, _ = layer_launches(dataclasses.replace(cfg, attention_output="nvfp4"))
    assert names == plain


def test_nvfp4_attention_output_needs_a_problem_the_cuda_kernel_takes():
    """A head the CUDA kernel does not take ("flash-mma" needs head_dim >= 32): the attention
    runs as "bf16" does (the Pallas fallback) and o_proj keeps its quantizer kernel, rather than
    XLA's quantizer ops after the fallback."""
    # o_proj's K = 16 heads x 16 = 256: the GEMV takes it
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=16,
                 num_heads=16, num_kv_heads=2, num_layers=2, attention="flash-mma")  # fmt: skip
    plain, _ = layer_launches(cfg)
    names, _ = layer_launches(dataclasses.replace(cfg, attention_output="nvfp4"))
    assert names == plain and names.count("nvfp4_quantize_bf16") == 4


def test_nvfp4_attention_output_keeps_bf16_from_the_gemm_rows():
    """At gemm_min_m rows the o_proj linear is the GEMM, which reads x_hat: "nvfp4" keeps the
    bf16 output and the quantizer there, and takes the codes path below it."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash", gemm_min_m=4)  # fmt: skip
    on = dataclasses.replace(cfg, attention_output="nvfp4")
    assert layer_launches(on, batch=4)[0] == layer_launches(cfg, batch=4)[0]
    assert len(layer_launches(on, batch=3)[0]) == len(layer_launches(cfg, batch=3)[0]) - 1


def test_nvfp4_attention_output_needs_a_static_scale():
    """o_proj without an input scale (per-row dynamic): the attention writes bf16."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash", attention_output="nvfp4")  # fmt: skip
    params = init_params(cfg, 0, jnp.bfloat16)
    logits = decode_logits(cfg, params, steps=2, b=2)
    base = decode_logits(dataclasses.replace(cfg, attention_output="bf16"), params, steps=2, b=2)
    np.testing.assert_array_equal(logits, base)


def test_config_attention_output_validated():
    with pytest.raises(ValueError, match="unknown attention_output 'fp4'"):
        Config(attention_output="fp4")


@needs_nvrtc
@pytest.mark.parametrize("mma", [0, 1])
def test_quant_out_builds_and_leaves_the_bf16_build_alone(mma, tmp_path, monkeypatch):
    """The QUANT_OUT build (Qwen3-8B shapes) compiles for sm_90 with no local memory: 8 operands
    and 5 results (+5 aliased when poisoned); XG_STACK picks the stacked scale; the bf16 build's
    defines (so its cache key and PTX) carry neither; xg_stack alone is refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    opts = flash.FlashOptions(mma=mma, warps=8 if mma else 4)
    plain = flash.flash_shape(1, 36, 1536, 8, 4, 128, opts)
    assert "QUANT_OUT" not in flash.defines(plain) and "XG_STACK" not in flash.defines(plain)
    for stacked in (False, True):
        shape = dataclasses.replace(plain, quant_out=True, xg_stack=stacked)
        assert flash.defines(shape)["QUANT_OUT"] == 1
        assert flash.defines(shape)["XG_STACK"] == int(stacked)
        assert (shape.n_inputs, shape.n_outputs) == (8, 5)
        kern = flash.build(shape, arch="compute_90")
        assert ".local" not in kern.ptx and cbuild.ptx_entries(kern.ptx) == {flash.ENTRY: 13}
        assert "cvt.rn.satfinite.e4m3x2.f32" in kern.ptx
        assert "output_indices = [8, 9, 10, 11, 12]" in kern.backend_config()
        poisoned = flash.build(dataclasses.replace(shape, poison=True), arch="compute_90")
        assert cbuild.ptx_entries(poisoned.ptx) == {flash.ENTRY: 18}
        assert "output_indices = [13, 14, 15, 16, 17]" in poisoned.backend_config()
    assert "cvt.rn.satfinite" not in flash.build(plain, arch="compute_90").ptx
    ok, why = flash.check_shape(dataclasses.replace(plain, xg_stack=True))
    assert not ok and "xg_stack" in why
