"""gate_up_proj writing down_proj's NVFP4 input (Config.gate_up_output="nvfp4") without a GPU:
`fused_linear_swiglu` is the quantizer (prologue "swiglu") of `fused_linear`'s gate_up output,
bitwise; the decoder with it is bitwise the "bf16" decoder off CUDA; the decode step's CUDA
lowering drops down_proj's quantizer launch (8 launches a layer with attention_output "nvfp4"
under "flash-mma") exactly where it applies; the GEMV's SWIGLU_OUT build compiles, its row
order pairs each gate row with its up row inside one CTA, and the other builds' PTX is
unchanged; bad arguments fail with the value named. The kernel's bytes are checked on the GPU
(tests/test_fused_linear_gpu.py)."""

import dataclasses
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _lowering import decode_logits, layer_launches, per_linear_scales, stacked_linear

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv
from rejax import layers, nvfp4
from rejax.config import Config
from rejax.ops.fused_linear import fused_linear, fused_linear_swiglu, swiglu_kernel_supported
from rejax.params import init_params

needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


def _gate_up(n=64, k=256):
    return stacked_linear(n, k, [2e-3, 4e-3])


@pytest.mark.parametrize("down_scale", [np.float32(3e-4), np.array([1e-3, 1e-6], np.float32)])
def test_swiglu_codes_are_the_quantizer_of_the_gate_up_output(down_scale):
    """Off CUDA, bitwise: quantize_activation(swiglu(gate, up), g) of fused_linear's bf16
    gate_up output, g the scalar or the layer's entry (1e-6 saturates the block scales)."""
    params = _gate_up()
    x = jax.random.normal(jax.random.key(2), (3, 256), jnp.bfloat16)
    norm = 1.0 + 0.1 * jax.random.normal(jax.random.key(3), (2, 256), jnp.bfloat16)
    for layer in (0, 1):
        li = jnp.int32(layer)
        h = fused_linear(x, params, layer=li, prologue="rmsnorm", norm=norm, eps=1e-6)
        g = down_scale if down_scale.ndim == 0 else down_scale[layer]
        want = nvfp4.quantize_activation(layers.swiglu(h[:, :32], h[:, 32:]), jnp.float32(g))
        run = jax.jit(
            lambda x, li: fused_linear_swiglu(x, params, down_scale, layer=li, norm=norm, eps=1e-6)
        )
        xp, xs, xg = run(x, li)
        np.testing.assert_array_equal(np.asarray(xp), np.asarray(want.packed))
        ws = np.asarray(jax.lax.bitcast_convert_type(want.scales, jnp.uint8))
        np.testing.assert_array_equal(np.asarray(xs), ws)
        np.testing.assert_array_equal(np.asarray(xg), np.full(3, g, np.float32))
        if down_scale.ndim:
            assert (ws == 0x7E).all() == (layer == 1)  # 448: saturated at g = 1e-6 only


def test_swiglu_codes_errors_name_the_value():
    params = _gate_up()
    x = jnp.zeros((3, 256), jnp.bfloat16)
    norm = jnp.ones((2, 256), jnp.bfloat16)
    call = lambda **kw: fused_linear_swiglu(
        **{"x": x, "params": params, "down_scale": np.float32(1), "layer": 0, "norm": norm, **kw}
    )
    with pytest.raises(ValueError, match=r"down_scale shape \(3,\)"):
        call(down_scale=np.ones(3, np.float32))
    with pytest.raises(ValueError, match=r"down_scale=0.0: expected finite and > 0"):
        call(down_scale=np.array([1, 0], np.float32))
    with pytest.raises(ValueError, match=r"x \(3, 128\) bfloat16, expected \[M, 256\]"):
        call(x=jnp.zeros((3, 128), jnp.bfloat16))
    with pytest.raises(ValueError, match=r"norm.shape=\(255,\)"):
        call(norm=jnp.ones((255,), jnp.bfloat16))
    with pytest.raises(ValueError, match="N=48 must be 2F with F a multiple of 16"):
        call(params=_gate_up(n=48))
    with pytest.raises(ValueError, match="pass layer= for a stack only"):
        call(layer=None)


def test_swiglu_kernel_supported_says_why():
    assert swiglu_kernel_supported(1, 24576, 4096) == (True, "")
    assert swiglu_kernel_supported(7, 1024, 256)[0]
    ok, why = swiglu_kernel_supported(2, 1024, 256)  # a small layer at M <= 2: streamed
    assert not ok and "streaming kernel" in why
    ok, why = swiglu_kernel_supported(8, 1024, 256)
    assert not ok and "take the GEMM" in why
    ok, why = swiglu_kernel_supported(1, 1040, 256)
    assert not ok and "multiple of 32" in why
    ok, why = swiglu_kernel_supported(1, 1024, 128)
    assert not ok and "K=128" in why
    ok, why = swiglu_kernel_supported(4, 96, 512)  # down's K = 48: XLA's quantizer on "bf16"
    assert not ok and "down's input F=48" in why


@pytest.mark.parametrize(
    "n,rows,grid", [(24576, 4, 132), (24576, 2, 132), (512, 4, 16), (1024, 8, 7), (96, 1, 2)]
)
def test_swiglu_row_order_pairs_gate_and_up_in_one_cta(n, rows, grid):
    """The kernel's row order (swiglu_unit_rows): every row once over the CTAs; in each CTA the
    local rows lu * 32 + i (i < 16) hold gate output 16 u + i and lu * 32 + 16 + i the up row
    of the same output, as its epilogue reads them; a CTA's rows fit the plan's buffer."""
    order = nvfp4_gemv.swiglu_unit_rows(n, rows, grid)
    allrows = np.concatenate(order)
    np.testing.assert_array_equal(np.sort(allrows), np.arange(n))
    f = n // 2
    for cta in order:
        units = cta.reshape(-1, 32)
        gate, up = units[:, :16], units[:, 16:]
        assert (gate < f).all() and (gate % 16 == np.arange(16)).all()
        np.testing.assert_array_equal(up, gate + f)
    most = max(len(c) for c in order)
    assert most <= -(-(n // 32) // grid) * 32  # RPC of the units plan (nvfp4_gemv.cu)


@pytest.mark.parametrize("n,k", [(24576, 4096), (17408, 5120), (1024, 256), (96, 512)])
def test_swiglu_plan_keeps_the_plain_plans_row_sums(n, k):
    """Where the plain GEMV is the persistent kernel, the SwiGLU plan has its R rows per step,
    K steps per part and K parts (so each row's sum is the plain kernel's, in its order), at
    most one CTA per unit, and room in its buffer for a CTA's whole units."""
    for m in range(1, 9):
        plain = nvfp4_gemv.plan("w4a4", m, n, k)
        if plain.variant != "persistent":
            continue
        units = nvfp4_gemv.plan_persistent("w4a4", m, n, k, units=True)
        same = ("rows", "spp", "threads")
        assert [getattr(units, f) for f in same] == [getattr(plain, f) for f in same]
        assert units.kparts == plain.kparts and units.grid == min(plain.grid, n // 32)
        most = max(len(c) for c in nvfp4_gemv.swiglu_unit_rows(n, units.rows, units.grid))
        rows_room = units.smem - units.ring * (units.threads // 32) * units.rows * 576
        assert rows_room >= -(-(m * k * 17 // 16) // 16) * 16 + units.kparts * most * m * 4


def test_decoder_gate_up_output_nvfp4_is_bitwise_bf16_off_cuda():
    """Decode steps' logits with gate_up_output "nvfp4" (and with attention_output "nvfp4"
    too) equal "bf16"'s bit for bit off CUDA, with static input scales on every linear."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, attention="flash-mma", gate_up_output="bf16")  # fmt: skip
    params = per_linear_scales(init_params(cfg, 3, jnp.bfloat16))
    base = decode_logits(cfg, params, steps=5, b=3)
    assert np.isfinite(base).all() and np.abs(base).max() > 0
    for change in ({"gate_up_output": "nvfp4"},
                   {"gate_up_output": "nvfp4", "attention_output": "nvfp4"}):  # fmt: skip
        got = decode_logits(dataclasses.replace(cfg, **change), params, steps=5, b=3)
        np.testing.assert_array_equal(got, base)


def test_cuda_lowering_drops_the_down_quantizer():
    """Lowered for CUDA: "nvfp4" takes one quantizer launch out of the scanned layer (11 -> 10
    under "live"; with attention_output "nvfp4" under "flash-mma", 8: 2 quantizers, 4 GEMVs,
    rope_cache, attention); the gate_up GEMV returns codes, scales and the global scale
    (u8 [3, F/2], u8 [3, F/16], f32 [3]) and takes down's scale as an operand (batch 3: the
    persistent GEMV's rows for this small layer)."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, gate_up_output="bf16")  # fmt: skip
    _, base = layer_launches(cfg, 3)
    names, body = layer_launches(dataclasses.replace(cfg, gate_up_output="nvfp4"), 3)
    launches = base.count("stablehlo.custom_call"), body.count("stablehlo.custom_call")
    assert launches == (11, 10), launches  # "live": 2 Pallas launches, not named by PTX entry
    assert names.count("nvfp4_quantize_bf16") == 3 and names.count("nvfp4_gemv_w4a4") == 4
    gemvs = [line for line in body.splitlines() if "nvfp4_gemv_w4a4" in line]
    outs = [line.rsplit("->", 1)[-1] for line in gemvs if "->" in line]
    three = [o for o in outs if o.count("tensor<") == 3]
    assert len(three) == 1, outs  # intermediate 512: F / 2 = 256 code bytes, 32 scales
    assert "tensor<3x256xui8>" in three[0] and "tensor<3x32xui8>" in three[0], three[0]
    full = dataclasses.replace(cfg, attention="flash-mma", attention_output="nvfp4",
                               gate_up_output="nvfp4")  # fmt: skip
    names, body = layer_launches(full, 3)
    assert len(names) == 8 and names.count("nvfp4_quantize_bf16") == 2
    assert body.count("stablehlo.custom_call") == 8


@pytest.mark.parametrize(
    "change,batch",
    [
        ({"linear_fusion": "unfused"}, 3),  # no fused quantizer to drop
        ({"linear_fusion": "fused"}, 3),  # one launch per linear already
        ({"gemm_min_m": 3}, 3),  # the GEMM's rows: it reads x_hat
        ({}, 2),  # this small gate_up at M <= 2 is the streaming GEMV's
    ],
)
def test_gate_up_output_nvfp4_applies_only_where_it_can(change, batch):
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, gate_up_output="bf16", **change)  # fmt: skip
    plain, _ = layer_launches(cfg, batch)
    names, _ = layer_launches(dataclasses.replace(cfg, gate_up_output="nvfp4"), batch)
    assert names == plain


def test_gate_up_output_nvfp4_needs_a_static_down_scale():
    """down_proj without an input scale (per-row dynamic): gate_up writes bf16."""
    cfg = Config(quant="nvfp4", hidden_size=256, intermediate_size=512, head_dim=64,
                 num_layers=2, gate_up_output="nvfp4")  # fmt: skip
    params = init_params(cfg, 0, jnp.bfloat16)
    logits = decode_logits(cfg, params, steps=2, b=3)
    base = decode_logits(dataclasses.replace(cfg, gate_up_output="bf16"), params, steps=2, b=3)
    np.testing.assert_array_equal(logits, base)


def test_config_gate_up_output_validated():
    with pytest.raises(ValueError, match="unknown gate_up_output 'fp4'"):
        Config(gate_up_output="fp4")


@needs_nvrtc
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_swiglu_out_builds_and_leaves_the_plain_build_alone(m, tmp_path, monkeypatch):
    """The SWIGLU_OUT GEMV (Qwen3-8B gate_up, 24576 x 4096) compiles for sm_90 without local
    memory: 8 operands (down's scale after layer) and 3 results; its plan gives each CTA whole
    32-row units; the plain build's defines (so its cache key and PTX) carry no SWIGLU_OUT; bad
    requests are refused."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    plain = nvfp4_gemv.build("w4a4", m, 24576, 4096, arch="compute_90", num_sms=132)
    assert "SWIGLU_OUT" not in plain.plan.defines()
    for mode in nvfp4_gemv.SWIGLU_OUTS:
        kern = nvfp4_gemv.build("w4a4", m, 24576, 4096, arch="compute_90", num_sms=132,
                                swiglu_out=mode)  # fmt: skip
        p = kern.plan
        assert p.defines()["SWIGLU_OUT"] == 1 and p.defines()["XGD_STACK"] == int(mode == "stacked")
        assert (p.n_inputs, p.n_outputs, p.variant) == (8, 3, "persistent")
        assert cbuild.ptx_entries(kern.ptx) == {"nvfp4_gemv_w4a4": 11}
        assert ".local" not in kern.ptx and "output_indices = [8, 9, 10]" in kern.backend_config()
        assert p.grid <= 24576 // 32
        with pytest.raises(nvfp4_gemv.KernelError, match="PTX call only"):
            kern.launch(0, [0] * 11)
    assert plain.ptx != kern.ptx
    for kw, word in (
        ({"swiglu_out": "yes"}, "swiglu_out='yes'"),
        ({"swiglu_out": "scalar", "residual": True}, "no residual"),
    ):
        with pytest.raises(nvfp4_gemv.KernelError, match=word):
            nvfp4_gemv.build("w4a4", m, 24576, 4096, arch="compute_90", num_sms=132, **kw)
    with pytest.raises(nvfp4_gemv.KernelError, match="multiple of 32"):
        nvfp4_gemv.build("w4a4", m, 24592, 4096, arch="compute_90", swiglu_out="scalar")
    with pytest.raises(nvfp4_gemv.KernelError, match="only for act='w4a4'"):
        nvfp4_gemv.build("w4a16", m, 24576, 4096, arch="compute_90", swiglu_out="scalar")


def test_swiglu_lowers_in_two_steps_where_the_kernel_does_not_serve():
    """Lowered for CUDA: at M = 3 the quantizer (RMSNorm) and the SWIGLU_OUT GEMV, two launches;
    at M = 2 on this small layer (the streaming GEMV's) the composition instead: the quantizer,
    the plain GEMV, the quantizer with the SwiGLU prologue, three launches; impl="ref" no
    kernel at all."""
    params = _gate_up(n=1024, k=256)
    norm = jnp.ones((2, 256), jnp.bfloat16)

    def names(m, impl="auto"):
        fn = jax.jit(
            lambda x: fused_linear_swiglu(
                x, params, np.float32(0.01), layer=1, norm=norm, impl=impl
            )
        )
        x = jax.ShapeDtypeStruct((m, 256), jnp.bfloat16)
        text = fn.trace(x).lower(lowering_platforms=("cuda",)).as_text()
        return re.findall(r"name = \\22(\w+)\\22", text)

    assert names(3) == ["nvfp4_quantize_bf16", "nvfp4_gemv_w4a4"]
    assert names(2) == ["nvfp4_quantize_bf16", "nvfp4_gemv_w4a4", "nvfp4_quantize_bf16"]
    assert names(3, "ref") == []
    with pytest.raises(ValueError, match="streaming kernel"):
        names(2, "cuda")


@needs_nvrtc
def test_prebuild_takes_swiglu_out(tmp_path, monkeypatch):
    """`prebuild` builds SWIGLU_OUT kernels as `build` does (the same cached object) and checks
    the request as `build` does."""
    monkeypatch.setenv("REJAX_KERNEL_CACHE", str(tmp_path))
    kw = {"arch": "compute_90", "num_sms": 132}
    (got,) = nvfp4_gemv.prebuild(
        [{"act": "w4a4", "m": 3, "n": 1024, "k": 256, "swiglu_out": "stacked"}], **kw
    )
    assert got is nvfp4_gemv.build("w4a4", 3, 1024, 256, swiglu_out="stacked", **kw)
    assert got.plan.swiglu_out == "stacked"
    with pytest.raises(nvfp4_gemv.KernelError, match="multiple of 32"):
        nvfp4_gemv.prebuild([{"act": "w4a4", "m": 3, "n": 1040, "k": 256, "swiglu_out": "scalar"}])
