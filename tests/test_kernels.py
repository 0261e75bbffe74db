"""CPU tests of the NVFP4 linear (rejax.ops.linear) and cuda_ops: dispatch, CUDA lowering,
NVRTC, shapes, kernel options.

GEMM letters: M rows of x, N out features, K in features.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from cuda_ops import build as cbuild
from cuda_ops import nvfp4_gemv
from rejax import nvfp4
from rejax.ops import _dispatch
from rejax.ops import linear as kernels


def _problem(m, n, k, seed=0, lead=()):
    rng = np.random.default_rng(seed)
    w = nvfp4.quantize_weight(rng.standard_normal((n, k)).astype(np.float32))
    x = jnp.asarray(rng.standard_normal((*lead, m, k)), jnp.bfloat16)
    return x, w


def _f32(a):
    return np.asarray(a, np.float32)


needs_nvrtc = pytest.mark.skipif(
    not cbuild.nvrtc_available(), reason="cuda-bindings / NVRTC not installed"
)


# ----------------------------------------------------------------------------- reference path


def _f64(x, w, act, input_scale=None):
    """float64 product of the same quantized operands (the kernel's and the reference's)."""
    wd = np.asarray(nvfp4.dequantize(w), np.float64)
    if act == "w4a4":
        xd = np.asarray(nvfp4.dequantize(nvfp4.quantize_activation(x, input_scale)), np.float64)
    else:
        xd = np.asarray(x, np.float64)
    return xd @ wd.T


def _assert_at_bf16_floor(y, y64):
    """|y - y64| <= 1.5x the error of y64 merely rounded to bf16 (Frobenius), as on the GPU."""
    y = np.asarray(y, np.float64).reshape(y64.shape)
    floor = np.linalg.norm(y64.astype(ml_dtypes.bfloat16).astype(np.float64) - y64)
    err = np.linalg.norm(y - y64)
    assert err <= 1.5 * floor + 1e-6 * np.linalg.norm(y64), (err, floor)


@pytest.mark.parametrize(
    ("act", "impl", "m"),
    [
        ("w4a4", "auto", 1),
        ("w4a4", "auto", 8),
        ("w4a4", "ref", 3),
        ("w4a4", "auto", 17),
        ("w4a16", "auto", 2),
        ("w4a16", "ref", 8),
    ],
)
def test_linear_matches_float64_of_the_quantized_operands(act, impl, m):
    x, w = _problem(m, 48, 256, seed=m)
    y = kernels.nvfp4_linear(x, w, act=act, impl=impl)
    assert y.shape == (m, 48) and y.dtype == jnp.bfloat16
    _assert_at_bf16_floor(y, _f64(x, w, act))


def test_stacked_weight_with_per_row_scales_reads_its_layer():
    """A stack of 3 matrices (fused shards with their own global scales: one scale per row),
    layer selected by a traced index, equals float64 of that layer's matrix."""
    rng = np.random.default_rng(11)
    layers = []
    for i in range(3):
        parts = [
            nvfp4.quantize_weight(rng.standard_normal((n, 256)).astype(np.float32) * (i + 1) * s)
            for n, s in ((32, 1.0), (16, 3.0))
        ]
        layers.append(nvfp4.concat_rows(parts))
    stack = nvfp4.stack(layers)
    assert stack.per_row and stack.global_scale.shape == (3, 48)
    x = jnp.asarray(rng.standard_normal((2, 256)), jnp.bfloat16)
    for act in ("w4a4", "w4a16"):
        f = jax.jit(lambda x, i, act=act: kernels.nvfp4_linear(x, stack, act=act, layer=i))
        for i in range(3):
            _assert_at_bf16_floor(f(x, jnp.int32(i)), _f64(x, layers[i], act))
    with pytest.raises(ValueError, match="pass layer="):
        kernels.nvfp4_linear(x, stack)
    with pytest.raises(ValueError, match="only used with a stacked"):
        kernels.nvfp4_linear(x, layers[0], layer=0)


def test_fused_shards_equal_the_unfused_linears():
    """q/k/v quantized with their own global scales, fused: each shard's columns equal its own
    linear bit for bit (same activation codes, same block dots, the shard's own alpha)."""
    rng = np.random.default_rng(12)
    parts = [
        nvfp4.quantize_weight(rng.standard_normal((n, 512)).astype(np.float32) * s)
        for n, s in ((64, 1.0), (32, 0.2), (32, 5.0))
    ]
    fused = nvfp4.concat_rows(parts)
    x = jnp.asarray(rng.standard_normal((3, 512)), jnp.bfloat16)
    scale = jnp.float32(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / (6 * 448))
    for act, s_in in (("w4a4", scale), ("w4a4", None), ("w4a16", None)):
        y = _f32(kernels.nvfp4_linear(x, fused, act=act, input_scale=s_in))
        got = np.split(y, [64, 96], axis=1)
        for part, g in zip(parts, got, strict=True):
            want = _f32(kernels.nvfp4_linear(x, part, act=act, input_scale=s_in))
            np.testing.assert_array_equal(g, want)
    back = nvfp4.split_rows(fused, (64, 32, 32))
    for a, b in zip(back, parts, strict=True):
        assert np.asarray(a.global_scale).shape == ()
        for field in ("packed", "scales", "global_scale"):
            np.testing.assert_array_equal(
                np.asarray(getattr(a, field)).reshape(-1).view(np.uint8),
                np.asarray(getattr(b, field)).reshape(-1).view(np.uint8),
            )


def test_static_input_scale_and_leading_dims():
    x, w = _problem(3, 48, 256, seed=1, lead=(2,))
    scale = jnp.float32(float(jnp.max(jnp.abs(x.astype(jnp.float32)))) / (6 * 448))
    y = jax.jit(lambda x, s: kernels.nvfp4_linear(x, w, input_scale=s))(x, scale)
    want = nvfp4.nvfp4_matmul(x.reshape(6, 256), w, input_scale=scale)
    assert y.shape == (2, 3, 48)
    np.testing.assert_array_equal(_f32(y.reshape(6, 48)), _f32(want))


def test_jit_eager_and_scan_agree():
    x, w = _problem(2, 48, 256, seed=2)
    eager = kernels.nvfp4_linear(x, w)

    def body(c, xi):
        return c, kernels.nvfp4_linear(xi, w)

    _, scanned = jax.jit(lambda xs: jax.lax.scan(body, 0, xs))(jnp.stack([x, x]))
    np.testing.assert_array_equal(_f32(scanned[0]), _f32(eager))
    np.testing.assert_array_equal(_f32(scanned[1]), _f32(eager))


def test_impl_cuda_raises_off_cuda():
    x, w = _problem(1, 16, 256)
    with pytest.raises(ValueError, match="needs the CUDA platform"):
        kernels.nvfp4_linear(x, w, impl="cuda")


@pytest.mark.parametrize(
    ("m", "k", "msg"),
    [(9, 272, "K=272"), (1, 272, "K=272"), (1, 128, "K=128")],
)
def test_impl_cuda_unsupported_shape_raises(m, k, msg):
    x, w = _problem(m, 16, k)
    with pytest.raises(ValueError, match=msg):
        kernels.nvfp4_linear(x, w, impl="cuda")
    if m > nvfp4_gemv.MAX_M:  # W4A16 above the GEMV's M: the GEMM is W4A4 only
        with pytest.raises(ValueError, match=f"M={m}"):
            kernels.nvfp4_linear(x, w, act="w4a16", impl="cuda")


def test_float32_activations_keep_reference_numerics():
    """float32 x (not representable in bf16): W4A16 multiplies the float32 values themselves
    (float64 check on x32, not on its bf16 rounding); W4A4 quantizes them."""
    x, w = _problem(2, 48, 256, seed=4)
    x32 = x.astype(jnp.float32) * 1.001  # not representable in bf16
    for act in ("w4a4", "w4a16"):
        _assert_at_bf16_floor(kernels.nvfp4_linear(x32, w, act=act), _f64(x32, w, act))
    with pytest.raises(ValueError, match="reads bfloat16"):
        kernels.nvfp4_linear(x32, w, act="w4a16", impl="cuda")


def test_bad_inputs_raise():
    x, w = _problem(1, 16, 256)
    with pytest.raises(ValueError, match="act="):
        kernels.nvfp4_linear(x, w, act="w8a8")
    with pytest.raises(ValueError, match="impl="):
        kernels.nvfp4_linear(x, w, impl="triton")
    with pytest.raises(ValueError, match="Nvfp4Tensor"):
        kernels.nvfp4_linear(x, np.zeros((16, 256), np.float32))
    with pytest.raises(ValueError, match=r"must end in K=256"):
        kernels.nvfp4_linear(x[:, :128], w)
    with pytest.raises(ValueError, match="input_scale"):
        kernels.nvfp4_linear(x, w, act="w4a16", input_scale=1.0)
    with pytest.raises(ValueError, match="dtype"):
        kernels.nvfp4_linear(x.astype(jnp.int32), w)


def test_residual_operand_is_added_after_the_linear():
    """gemv_call(residual=r) is r + gemv_call() (the bf16 add; on CPU the reference), W4A4 only,
    with res [M, N] bf16; the GEMV builds with the residual for act "w4a4" only."""
    x, w = _problem(3, 64, 256, seed=5)
    args = kernels._operands(x, w, "w4a4", None, None)
    r = jnp.asarray(np.random.default_rng(6).standard_normal((3, 64)), jnp.bfloat16)
    kw = {"act": "w4a4", "n": 64, "k": 256, "impl": "auto", "launch": "ptx"}
    got = jax.jit(lambda r, *a: kernels.gemv_call(a, residual=r, **kw))(r, *args)
    want = jax.jit(lambda r, *a: r + kernels.gemv_call(a, **kw))(r, *args)
    np.testing.assert_array_equal(_f32(got), _f32(want))
    assert not np.array_equal(_f32(got), _f32(kernels.gemv_call(args, **kw)))
    with pytest.raises(ValueError, match=r"residual \(3, 65\) bfloat16, expected \(3, 64\) bf16"):
        kernels.gemv_call(args, residual=jnp.zeros((3, 65), jnp.bfloat16), **kw)
    with pytest.raises(ValueError, match="float32, expected"):
        kernels.gemv_call(args, residual=r.astype(jnp.float32), **kw)
    w16 = kernels._operands(x, w, "w4a16", None, None)
    with pytest.raises(ValueError, match="only for act='w4a4'"):
        kernels.gemv_call(w16, residual=r, **{**kw, "act": "w4a16"})
    for act in ("w4a16", "w4a4x"):
        with pytest.raises(nvfp4_gemv.KernelError, match=f"only for act='w4a4', got act='{act}'"):
            nvfp4_gemv.build(act, 1, 64, 256, arch="compute_90", residual=True)
        with pytest.raises(nvfp4_gemv.KernelError, match="only for act='w4a4'"):
            nvfp4_gemv.prebuild([{"act": act, "m": 1, "n": 64, "k": 256, "residual": True}])
    with pytest.raises(nvfp4_gemv.KernelError, match="residual=1, expected a bool"):
        nvfp4_gemv.build("w4a4", 1, 64, 256, arch="compute_90", residual=1)


# ----------------------------------------------------------------------------- shape plan


def test_check_shape_and_plan():
    assert nvfp4_gemv.check_shape("w4a4", 8, 4096, 12288) == (True, "")
    assert not nvfp4_gemv.check_shape("w4a4", 0, 4096, 4096)[0]
    assert "K=4000" in nvfp4_gemv.check_shape("w4a16", 1, 4096, 4000)[1]
    ok, why = nvfp4_gemv.check_shape("w4a4", 8, 4096, 32768)  # 8 x 32768 int8 > 227 KiB smem
    assert not ok and "shared memory" in why
    for act in ("w4a4", "w4a16"):
        for m in range(1, 9):
            for n, k in [(6144, 4096), (4096, 12288), (5120, 25600), (1000, 3584), (8, 256)]:
                p = nvfp4_gemv.plan(act, m, n, k, options=PERSISTENT)
                assert n % p.rows == 0 and p.rows * m <= 32
                assert p.grid <= nvfp4_gemv.DEFAULT_SMS and p.grid * p.rows <= n
                assert p.kparts * p.spp >= -(-k // 1024) > (p.kparts - 1) * p.spp
                if nvfp4_gemv.check_shape(act, m, n, k)[0]:
                    assert p.smem <= nvfp4_gemv.SMEM_LIMIT
                # the cp.async ring: at M = 8 where it fits (two slots or more), else off
                warps, slot = p.threads // 32, nvfp4_gemv.SLOT_BYTES_PER_ROW * p.rows
                base = p.smem - p.ring * warps * slot
                fits = (nvfp4_gemv.SMEM_LIMIT - base) // (warps * slot) >= 2
                assert p.ring == (nvfp4_gemv.RING_MAX if m == 8 and fits else 0)
    # act W4A4, M = 8, K = 25600: the staged x leaves no room for a ring
    assert nvfp4_gemv.plan("w4a4", 8, 5120, 25600).ring == 0
    opts = nvfp4_gemv.GemvOptions(variant="persistent", ring=3)
    assert nvfp4_gemv.plan("w4a4", 1, 4096, 12288, options=opts).ring == 3


PERSISTENT = nvfp4_gemv.GemvOptions(variant="persistent")
STREAM = nvfp4_gemv.GemvOptions(variant="stream")


def test_kernel_options_are_arguments_not_environment(monkeypatch):
    """The plan reads no environment variable (a stale shell variable cannot change a kernel);
    bad options raise with the field named."""
    for var in ("REJAX_GEMV_VARIANT", "REJAX_GEMV_ROWS", "REJAX_GEMV_RING", "REJAX_GEMV_THREADS"):
        monkeypatch.setenv(var, "3" if var != "REJAX_GEMV_VARIANT" else "stream")
    assert nvfp4_gemv.plan("w4a4", 1, 4096, 12288) == nvfp4_gemv.plan(
        "w4a4", 1, 4096, 12288, options=nvfp4_gemv.DEFAULT_OPTIONS
    )
    assert nvfp4_gemv.plan("w4a4", 1, 4096, 12288).variant == "persistent"
    with pytest.raises(nvfp4_gemv.KernelError, match="variant='fastest'"):
        nvfp4_gemv.GemvOptions(variant="fastest")
    with pytest.raises(nvfp4_gemv.KernelError, match="rows=-1"):
        nvfp4_gemv.GemvOptions(rows=-1)
    with pytest.raises(nvfp4_gemv.KernelError, match="GemvOptions"):
        nvfp4_gemv.build("w4a4", 1, 64, 256, options={"variant": "stream"})


def test_auto_variant_choice():
    """Default plan: the streaming kernel for M <= 2 on layers of <= 16 MiB NVFP4 bytes (where it
    measured faster), else the persistent one."""
    cases = {
        (1, 4096, 4096): "stream",  # 9.4 MB
        (2, 3584, 3584): "stream",
        (1, 6144, 4096): "stream",  # 14.2 MB
        (1, 7168, 5120): "persistent",  # 20.6 MB
        (1, 4096, 12288): "persistent",
        (3, 4096, 4096): "persistent",
        (8, 1024, 1024): "persistent",
    }
    for (m, n, k), want in cases.items():
        assert nvfp4_gemv.plan("w4a4", m, n, k).variant == want, (m, n, k)


def test_stream_plan():
    """The streaming variant: only where asked and M <= 4; its geometry covers every row and
    chunk, bounds the chunks per lane, and fills the SMs."""
    assert nvfp4_gemv.plan("w4a4", 1, 4096, 4096, options=PERSISTENT).variant == "persistent"
    assert nvfp4_gemv.plan("w4a4", 8, 4096, 4096, options=STREAM).variant == "persistent"
    for act in ("w4a4", "w4a16"):
        for m in range(1, 5):
            for n, k in [
                (1024, 4096),
                (12288, 4096),
                (4096, 12288),
                (5120, 25600),
                (1003, 1280),
                (8, 256),
                (1, 512),
            ]:
                p = nvfp4_gemv.plan(act, m, n, k, options=STREAM)
                assert p.variant == "stream" and p.smem == 0 and n % p.rows == 0
                warps = p.threads // 32
                assert warps % p.ksplit == 0 and p.threads <= 1024
                gpb = warps // p.ksplit
                assert (p.grid - 1) * gpb * p.rows < n <= p.grid * gpb * p.rows
                nch = k // 32
                cps = -(-nch // p.ksplit)
                assert p.ksplit * cps >= nch and -(-cps // 32) <= 4
    big = nvfp4_gemv.plan("w4a4", 1, 1024, 4096, options=STREAM)  # few rows: K split
    assert big.ksplit > 1 and big.grid * big.threads // 32 >= 8 * nvfp4_gemv.DEFAULT_SMS


# ----------------------------------------------------------------------------- decode tables


def _prmt(lo: int, hi: int, sel: int) -> int:
    """PTX prmt.b32 default mode (with the sign-replicate bit)."""
    src = (lo | (hi << 32)).to_bytes(8, "little")
    out = bytearray(4)
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = src[nib & 7]
        out[i] = (0xFF if byte & 0x80 else 0x00) if nib & 8 else byte
    return int.from_bytes(out, "little")


def _table(name: str) -> int:
    # The decode tables live in the header every NVFP4 kernel includes.
    src = (cbuild.SOURCE_DIR / "common.cuh").read_text()
    return int(re.search(rf"#define {name} (0x[0-9A-Fa-f]+)u", src).group(1), 16)


def _s8(word: int) -> list[int]:
    return [b - 256 if b > 127 else b for b in word.to_bytes(4, "little")]


def test_prmt_decode_tables_are_exact():
    """The kernel's decodes give 2 * E2M1 value for all codes: the (pos, neg) pair of the weights
    at M <= 2 and the signed word (act_to_s8) of the activations and of the weights at M > 2."""
    tp, tn, tm = ((_table(f"{t}_LO"), _table(f"{t}_HI")) for t in ("TP", "TN", "TM"))
    want = (2 * nvfp4.E2M1_VALUES).astype(int)
    for sel in range(1 << 16):  # every combination of 4 codes
        codes = [(sel >> (4 * i)) & 0xF for i in range(4)]
        pos = _s8(_prmt(*tp, sel))
        neg = _s8(_prmt(*tn, sel ^ 0x8888))
        assert [p + q for p, q in zip(pos, neg, strict=True)] == [want[c] for c in codes]
        # act_to_s8: bytewise pos - neg without borrows
        a, b = _prmt(*tm, sel), _prmt(*tm, sel ^ 0x8888)
        x = (((a | 0x80808080) - b) & 0xFFFFFFFF) ^ 0x80808080
        assert _s8(x) == [want[c] for c in codes]


def test_fp16_bit_trick_is_exact():
    """W4A16 decode: ((v << (9 - 4i)) & 0x0E000E00) | ((v << (12 - 4i)) & 0x80008000)."""
    rng = np.random.default_rng(0)
    for v in [int(a) for a in rng.integers(0, 2**32, 2000, dtype=np.uint64)] + [0x89ABCDEF]:
        for i in range(4):
            mag = ((v << (9 - 4 * i)) if i <= 2 else (v >> 3)) & 0x0E000E00
            sgn = ((v << (12 - 4 * i)) if i <= 2 else v) & 0x80008000
            h = np.array([(mag | sgn) & 0xFFFF, (mag | sgn) >> 16], np.uint16).view(np.float16)
            codes = [(v >> (4 * i)) & 0xF, (v >> (4 * (i + 4))) & 0xF]
            got = h.astype(np.float64) * 2.0**14
            np.testing.assert_array_equal(got, nvfp4.E2M1_VALUES[codes].astype(np.float64))


# ----------------------------------------------------------------------------- CUDA lowering


def _custom_calls(text: str):
    return re.findall(r"stablehlo\.custom_call @([\w$.]+)\((.*?)\) \{(.*?)\} :", text)


def _config_fields(text: str) -> dict:
    cfg = re.search(r'backend_config = "(.*?)"(?:,|\s*\})', text, re.DOTALL).group(1)
    fields = dict(re.findall(r"(\w+) = (\d+)", re.sub(r"kernel_data = \\22.*?\\22", "", cfg)))
    fields["name"] = re.search(r"name = \\22(\w+)\\22", cfg).group(1)
    fields["kernel_type"] = re.search(r"kernel_type = \\22(\w+)\\22", cfg).group(1)
    fields["kernel_data"] = re.search(r"kernel_data = \\22(.*?)\\22, grid_x", cfg, re.DOTALL).group(
        1
    )
    fields["output_indices"] = re.search(r"output_indices = \[([\d, ]*)\]", cfg).group(1)
    return fields


def _unprint(s: str) -> str:
    """Undoes the printer's escaping of a string attribute (\\ -> \\, \\XX -> byte)."""
    return re.sub(
        r"\\(\\|[0-9A-Fa-f]{2})",
        lambda m: "\\" if m.group(1) == "\\" else chr(int(m.group(1), 16)),
        s,
    )


def _mlir_unescape(s: str) -> str:
    """MLIR string-literal escapes: \\\\, \\", \\n, \\t and \\XX (two hex digits)."""
    out, i = [], 0
    simple = {"\\": "\\", '"': '"', "n": "\n", "t": "\t"}
    while i < len(s):
        if s[i] != "\\":
            out.append(s[i])
            i += 1
        elif s[i + 1] in simple:
            out.append(simple[s[i + 1]])
            i += 2
        else:
            out.append(chr(int(s[i + 1 : i + 3], 16)))  # raises on a bad escape
            i += 3
    return "".join(out)


def _sha(s: str) -> str:
    return hashlib.sha256(s.encode()).hexdigest()


@pytest.fixture
def stub_compiler(monkeypatch):
    """Replaces NVRTC with a stub so lowering is checked without cuda-python."""
    seen = []

    def fake_compile(source, *, name, defines, arch, options=(), use_cache=True):
        seen.append((defines, arch))
        entry = "nvfp4_gemv_w4a4" if defines["ACT_W4A4"] else "nvfp4_gemv_w4a16"
        nparams = 8 + defines.get("EPI_RES", 0) if defines["ACT_W4A4"] else 6  # + res [M, N]
        params = ", ".join(f".param .u64 p{i}" for i in range(nparams))
        return f'.version 9.0\n.target sm_90\n.visible .entry {entry}({params})\n{{ ret; }} // "q" a\\b\t\n'

    monkeypatch.setattr(nvfp4_gemv, "compile_ptx", fake_compile)
    nvfp4_gemv._build_cached.cache_clear()
    yield seen
    nvfp4_gemv._build_cached.cache_clear()


@pytest.mark.parametrize(("act", "n_in"), [("w4a4", 7), ("w4a16", 5)])
def test_cuda_lowering_emits_ptx_custom_call(stub_compiler, act, n_in):
    x, w = _problem(4, 96, 512)
    f = jax.jit(lambda x: kernels.nvfp4_linear(x, w, act=act))
    text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    calls = [c for c in _custom_calls(text) if c[0] == "__gpu$xla.gpu.ptx"]
    assert len(calls) == 1
    _target, operands, attrs = calls[0]
    assert len(operands.split(",")) == n_in
    assert "api_version = 2" in attrs
    fields = _config_fields(text)
    p = nvfp4_gemv.plan(act, 4, 96, 512)
    assert fields["name"] == nvfp4_gemv.ENTRY[act] and fields["kernel_type"] == "ptx"
    assert (int(fields["grid_x"]), int(fields["grid_y"]), int(fields["grid_z"])) == (p.grid, 1, 1)
    assert int(fields["block_x"]) == p.threads and int(fields["shared_mem_bytes"]) == p.smem
    assert fields["output_indices"] == str(n_in)
    # the PTX travels MLIR-escaped inside the printed string attribute: decode it the way the
    # MLIR parser does and compare with the compiler's output by hash
    ptx = nvfp4_gemv.compile_ptx("", name="", defines=p.defines(), arch="compute_90")
    assert _sha(_mlir_unescape(_unprint(fields["kernel_data"]))) == _sha(ptx)
    assert re.search(r"-> tensor<4x96xbf16>", text)
    assert stub_compiler[-1][0]["M_TOK"] == 4 and stub_compiler[-1][1] == "compute_90"


def test_cuda_lowering_callback_path(stub_compiler):
    x, w = _problem(2, 64, 256)
    args = kernels._operands(x, w, "w4a4", None, None)
    f = jax.jit(
        lambda *a: kernels.gemv_call(a, act="w4a4", n=64, k=256, impl="auto", launch="callback")
    )
    text = f.trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = [c[0] for c in _custom_calls(text)]
    assert any("callback" in t and "cmd_buffer" in t for t in targets), targets
    assert "__gpu$xla.gpu.ptx" not in targets


def test_cpu_lowering_never_compiles(stub_compiler):
    x, w = _problem(2, 64, 256)
    text = jax.jit(lambda x: kernels.nvfp4_linear(x, w)).trace(x).lower().as_text()
    assert "custom_call @__gpu" not in text and not stub_compiler


def test_large_m_lowers_to_the_dot_reference_on_cuda(stub_compiler):
    """W4A16 at M = 16 on CUDA (W4A4 takes the GEMM there, tests/test_gemm.py): one dispatch
    decision (logged once, with the reason), the reference lowered as one tensor-core dot
    (dot_general on bf16 operands), never the sequential block scan (a while loop) that the CPU
    reference uses at this M."""
    x, w = _problem(16, 64, 256)
    f = jax.jit(lambda x: kernels.nvfp4_linear(x, w, act="w4a16"))
    with pytest.warns(UserWarning, match="M=16"):
        text = f.trace(x).lower(lowering_platforms=("cuda",)).as_text()
    assert "__gpu$xla.gpu.ptx" not in text and not stub_compiler
    assert "stablehlo.while" not in text and "dot_general" in text and "bf16" in text
    assert ("nvfp4_linear", "act='w4a16' at M=16 (the tensor-core GEMM is W4A4 only)") in (
        _dispatch.noted()
    )
    cpu = jax.jit(lambda x: kernels.nvfp4_linear(x, w, act="w4a16")).trace(x).lower().as_text()
    assert "stablehlo.while" in cpu  # the CPU reference adds blocks in the kernel's order


# ----------------------------------------------------------------------------- NVRTC


@needs_nvrtc
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
@pytest.mark.parametrize(("m", "n", "k"), [(1, 4096, 4096), (2, 5120, 25600), (4, 1003, 1280)])
def test_nvrtc_compiles_stream_variant(tmp_path, monkeypatch, act, m, n, k):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    kernel = nvfp4_gemv.build(act, m, n, k, arch="compute_90", options=STREAM)
    assert kernel.plan.variant == "stream"
    assert cbuild.ptx_entries(kernel.ptx) == {kernel.entry: nvfp4_gemv.N_INPUTS[act] + 1}
    assert ".local" not in kernel.ptx  # loads and sums stay in registers
    nvfp4_gemv._build_cached.cache_clear()


@needs_nvrtc
@pytest.mark.parametrize("act", ["w4a4", "w4a16"])
@pytest.mark.parametrize("ring", ["0", "2", "4"])
def test_nvrtc_compiles_ring_and_register_pipelines(tmp_path, monkeypatch, act, ring):
    """The persistent kernel with and without the cp.async ring: no local memory, and the ring
    build copies through cp.async (one commit per slot refill)."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    opts = nvfp4_gemv.GemvOptions(variant="persistent", ring=int(ring))
    kernel = nvfp4_gemv.build(act, 3, 1000, 3584, arch="compute_90", options=opts)
    assert kernel.plan.ring == int(ring)
    assert cbuild.ptx_entries(kernel.ptx) == {kernel.entry: nvfp4_gemv.N_INPUTS[act] + 1}
    assert ".local" not in kernel.ptx
    assert ("cp.async.cg.shared.global" in kernel.ptx) == (ring != "0")
    assert ("cp.async.wait_group" in kernel.ptx) == (ring != "0")
    nvfp4_gemv._build_cached.cache_clear()


@needs_nvrtc
def test_ctas_per_sm_option_compiles_for_that_occupancy(tmp_path, monkeypatch):
    """GemvOptions(ctas=2): a grid of 2 x #SMs CTAs compiled for 2 resident CTAs per SM
    (`.minnctapersm 2`, which caps ptxas at 64 registers for 512 threads); the default is one;
    a plan whose shared memory does not fit twice in an SM is refused, bad values are refused."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    try:
        two = nvfp4_gemv.GemvOptions(variant="persistent", rows=2, ctas=2)
        kernel = nvfp4_gemv.build("w4a4", 1, 4096, 12288, arch="compute_90", num_sms=132,
                                  options=two)  # fmt: skip
        assert kernel.plan.grid == 264 and kernel.plan.ctas == 2
        assert re.search(r"\.minnctapersm\s+2\b", kernel.ptx)
        assert "grid_x = 264," in kernel.backend_config()
        one = nvfp4_gemv.build("w4a4", 1, 4096, 12288, arch="compute_90", num_sms=132,
                               options=nvfp4_gemv.GemvOptions(variant="persistent"))  # fmt: skip
        assert one.plan.grid == 132 and re.search(r"\.minnctapersm\s+1\b", one.ptx)
        with pytest.raises(nvfp4_gemv.KernelError, match="2 CTAs per SM need"):
            nvfp4_gemv.build("w4a4", 8, 4096, 12288, arch="compute_90", options=two)
        with pytest.raises(nvfp4_gemv.KernelError, match="ctas=0"):
            nvfp4_gemv.GemvOptions(ctas=0)
    finally:
        nvfp4_gemv._build_cached.cache_clear()


@needs_nvrtc
@pytest.mark.parametrize(
    ("m", "n", "k", "variant"),
    [
        (1, 4096, 4096, "auto"),  # Qwen3-8B o_proj: stream, K split over 2 warps
        (1, 4096, 12288, "auto"),  # down_proj: persistent
        (3, 1003, 1280, "stream"),  # stream, no K split
        (4, 4096, 4096, "stream"),
        (8, 4096, 12288, "auto"),  # persistent with the cp.async ring
    ],
)
def test_nvrtc_compiles_the_residual_epilogue(tmp_path, monkeypatch, m, n, k, variant):
    """build("w4a4", residual=True) adds -DEPI_RES=1: the entry takes res [M, N] after xg (9
    parameters, output index 8), stays in registers, and rounds twice per output store (the
    GEMV's bf16 value, then the sum); without it the kernel is the one of -DEPI_RES=0."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    opts = nvfp4_gemv.GemvOptions(variant=variant)
    plain = nvfp4_gemv.build("w4a4", m, n, k, arch="compute_90", options=opts)
    res = nvfp4_gemv.build("w4a4", m, n, k, arch="compute_90", options=opts, residual=True)
    zero = dataclasses.replace(opts, defines=(("EPI_RES", "0"),))
    assert nvfp4_gemv.build("w4a4", m, n, k, arch="compute_90", options=zero).ptx == plain.ptx
    assert "EPI_RES" not in plain.plan.defines() and res.plan.defines()["EPI_RES"] == 1
    assert res.plan.n_inputs == 8 and "output_indices = [8]" in res.backend_config()
    assert cbuild.ptx_entries(res.ptx) == {"nvfp4_gemv_w4a4": 9}
    assert ".local" not in res.ptx
    stores = plain.ptx.count("st.global.u16")
    assert stores >= 1 and res.ptx.count("st.global.u16") == stores
    assert plain.ptx.count("cvt.rn.bf16.f32") == stores
    assert res.ptx.count("cvt.rn.bf16.f32") == 2 * stores
    nvfp4_gemv._build_cached.cache_clear()


def _ptx_by_options(values, m=1, **fixed):
    """PTX of the W4A4 1024 x 4096 kernel at M = m for each GemvOptions(**fixed, **value)."""
    out = {}
    for name, kw in values.items():
        nvfp4_gemv._build_cached.cache_clear()
        opts = nvfp4_gemv.GemvOptions(**fixed, **kw)
        out[name] = nvfp4_gemv.build("w4a4", m, 1024, 4096, arch="compute_90", options=opts).ptx
    nvfp4_gemv._build_cached.cache_clear()
    return out


DIAG = "experiments/kernels/nvfp4_gemv_diag.cu"


@needs_nvrtc
def test_product_kernel_has_no_diagnostics_and_experiments_keep_theirs(tmp_path, monkeypatch):
    """The diagnostics (wrong numbers on purpose) and the two-plane layout live only in the
    experiments' copy of the kernel, compiled through GemvOptions(source=...)."""
    src = cbuild.read_source(nvfp4_gemv.SOURCE)
    for name in ("DIAG_NODOT", "DIAG_LOADONLY", "XPLANES"):
        assert name not in src
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    ptx = _ptx_by_options(
        {
            "prod": {},
            "diag": {"source": DIAG},
            "loadonly": {"source": DIAG, "defines": (("DIAG_LOADONLY", "1"),)},
        },
        variant="persistent",
    )
    assert ptx["prod"] == ptx["diag"]  # the copy without its switches is the product kernel
    assert ptx["prod"].count("dp4a.") > 0 and ptx["loadonly"].count("dp4a.") == 0


@needs_nvrtc
def test_source_option_compiles_another_revision(tmp_path, monkeypatch):
    """GemvOptions(source=...) compiles the given file instead of cuda_ops/nvfp4_gemv.cu (A/B
    runs); a missing file is a clear error naming the option."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path / "cache"))
    src = tmp_path / "other.cu"
    src.write_text(
        cbuild.read_source(nvfp4_gemv.SOURCE) + '\nextern "C" __global__ void ab_marker() {}\n'
    )
    ptx = _ptx_by_options({"prod": {}, "alt": {"source": str(src)}})
    assert "ab_marker" in cbuild.ptx_entries(ptx["alt"])
    assert "ab_marker" not in cbuild.ptx_entries(ptx["prod"])
    nvfp4_gemv._build_cached.cache_clear()
    with pytest.raises(nvfp4_gemv.KernelError, match="source=.*missing.cu"):
        opts = nvfp4_gemv.GemvOptions(source=str(tmp_path / "missing.cu"))
        nvfp4_gemv.build("w4a4", 1, 1024, 4096, arch="compute_90", options=opts)
    nvfp4_gemv._build_cached.cache_clear()


@needs_nvrtc
def test_signed_weight_decode_halves_the_dp4a(tmp_path, monkeypatch):
    """W4A4 at M > 2 decodes weights to signed int8 by default: half the dp4a of the (pos, neg)
    decode (-DSIGNED_W=0); at M <= 2 the pair decode stays."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    counts = {}
    for m in (2, 4):
        ptx = _ptx_by_options(
            {"default": {}, "pair": {"defines": (("SIGNED_W", "0"),)}}, m=m, variant="persistent"
        )
        for name, text in ptx.items():
            counts[m, name] = text.count("dp4a.")
            assert ".local" not in text
    assert counts[4, "default"] * 2 == counts[4, "pair"]
    assert counts[2, "default"] == counts[2, "pair"]


@needs_nvrtc
def test_gw_rows_reads_one_global_scale_per_row(tmp_path, monkeypatch):
    """Per-row weight global scales compile to a different kernel with no local memory."""
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    for act in ("w4a4", "w4a16"):
        nvfp4_gemv._build_cached.cache_clear()
        one = nvfp4_gemv.build(act, 1, 1024, 4096, arch="compute_90").ptx
        rows = nvfp4_gemv.build(act, 1, 1024, 4096, arch="compute_90", gw_rows=True).ptx
        assert one != rows and ".local" not in rows
    nvfp4_gemv._build_cached.cache_clear()


def test_cache_key_hashes_included_headers(tmp_path):
    """A kernel source's local headers are hashed into the PTX cache key: editing a header
    changes the key; a missing header is an error naming it."""
    (tmp_path / "common.cuh").write_text("#define X 1\n")
    src = '#include "common.cuh"\n__global__ void k() {}\n'
    h1 = cbuild.local_headers(src, tmp_path)
    assert h1 == {"common.cuh": "#define X 1\n"}
    k1 = cbuild._key(src, h1, {}, "compute_90", (13, 0), ())
    (tmp_path / "common.cuh").write_text("#define X 2\n")
    h2 = cbuild.local_headers(src, tmp_path)
    assert cbuild._key(src, h2, {}, "compute_90", (13, 0), ()) != k1
    with pytest.raises(cbuild.KernelError, match="missing.cuh"):
        cbuild.local_headers('#include "missing.cuh"\n', tmp_path)


def test_local_headers_search_several_directories_in_order(tmp_path):
    """An experiment's headers: the first directory that has a header gives it; headers it
    includes are found in any of them; a missing one names every directory searched."""
    own, shared = tmp_path / "own", tmp_path / "shared"
    own.mkdir(), shared.mkdir()
    (own / "ring.cuh").write_text('#include "common.cuh"\n#define R 1\n')
    (own / "both.cuh").write_text("#define B 1\n")
    (shared / "both.cuh").write_text("#define B 2\n")
    (shared / "common.cuh").write_text("#define C 1\n")
    src = '#include "ring.cuh"\n#include "both.cuh"\n'
    found = cbuild.local_headers(src, (own, shared))
    assert found == {
        "ring.cuh": '#include "common.cuh"\n#define R 1\n',
        "both.cuh": "#define B 1\n",
        "common.cuh": "#define C 1\n",
    }
    assert cbuild.local_headers(src, (shared, own))["both.cuh"] == "#define B 2\n"
    with pytest.raises(cbuild.KernelError, match=r'"nope.cuh": no such header in own/, shared/'):
        cbuild.local_headers('#include "nope.cuh"\n', (own, shared))


@needs_nvrtc
def test_compile_cubin_and_ptxas_log_are_one_offline_build(tmp_path):
    """compile_cubin gives the sm_90 ELF ptxas_log reports on (with an experiment's header
    directory); a source that does not compile raises with NVRTC's log."""
    (tmp_path / "inc.cuh").write_text("#define SCALE 3\n")
    src = '#include "inc.cuh"\nextern "C" __global__ void k(int* p) { p[0] *= SCALE + N; }\n'
    cubin = cbuild.compile_cubin(src, {"N": 2}, header_dirs=(tmp_path,))
    assert cubin[:4] == b"\x7fELF" and b"k" in cubin
    assert cubin != cbuild.compile_cubin(src, {"N": 5}, header_dirs=(tmp_path,))
    log = cbuild.ptxas_log(src, {"N": 2}, header_dirs=(tmp_path,))
    assert "Compiling entry function 'k' for 'sm_90'" in log and "Used" in log
    with pytest.raises(cbuild.KernelError, match="NVRTC failed"):
        cbuild.compile_cubin(src.replace("SCALE", "UNDEFINED"), {"N": 2}, header_dirs=(tmp_path,))


def test_device_arch_and_sms_of_a_device_or_the_defaults():
    """Plans read the device's arch and SM count (a MIG instance reports its own SMs), and the
    defaults where a device says nothing (no GPU: lowering for CUDA on the CPU)."""
    from types import SimpleNamespace

    mig = SimpleNamespace(compute_capability="9.0", core_count=16)
    assert (cbuild.device_arch(mig), cbuild.device_sms(mig)) == ("compute_90", 16)
    assert cbuild.device_sms(SimpleNamespace(core_count=None)) == cbuild.DEFAULT_SMS
    assert cbuild.device_arch(SimpleNamespace()) == cbuild.DEFAULT_ARCH
    with pytest.raises(cbuild.KernelError, match="compute capability 8.0"):
        cbuild.device_arch(SimpleNamespace(compute_capability="8.0"))
    if jax.devices()[0].platform != "gpu":  # no CUDA device here: the defaults
        assert (cbuild.device_arch(), cbuild.device_sms()) == ("compute_90", cbuild.DEFAULT_SMS)


@needs_nvrtc
@pytest.mark.parametrize("arch", ["compute_90", "compute_100"])
@pytest.mark.parametrize(("act", "m"), [("w4a4", 1), ("w4a4", 8), ("w4a16", 3)])
def test_nvrtc_compiles_for_hopper_and_blackwell(tmp_path, monkeypatch, arch, act, m):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    nvfp4_gemv._build_cached.cache_clear()
    kernel = nvfp4_gemv.build(act, m, 4096, 3584, arch=arch)
    assert cbuild.ptx_target(kernel.ptx) == arch.replace("compute_", "sm_")
    assert cbuild.ptx_entries(kernel.ptx) == {kernel.entry: nvfp4_gemv.N_INPUTS[act] + 1}
    # no local-memory tables in the decode (a runtime-indexed array would show .local)
    assert ".local" not in kernel.ptx
    assert list(tmp_path.glob("*.ptx")), "PTX was not cached on disk"
    nvfp4_gemv._build_cached.cache_clear()


@needs_nvrtc
def test_nvrtc_errors_are_reported(tmp_path, monkeypatch):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    with pytest.raises(cbuild.KernelError, match="NVRTC failed"):
        cbuild.compile_ptx("this is not CUDA", name="bad.cu", arch="compute_90")
    with pytest.raises(cbuild.KernelError, match="arch="):
        cbuild.compile_ptx("", arch="sm90")


@needs_nvrtc
def test_disk_cache_is_keyed_and_reused(tmp_path, monkeypatch):
    monkeypatch.setenv(cbuild.CACHE_ENV, str(tmp_path))
    src = 'extern "C" __global__ void k(int* p) { p[0] = VALUE; }'
    a = cbuild.compile_ptx(src, defines={"VALUE": 1}, arch="compute_90")
    b = cbuild.compile_ptx(src, defines={"VALUE": 2}, arch="compute_90")
    assert a != b and len(list(tmp_path.glob("*.ptx"))) == 2
    (path,) = [p for p in tmp_path.glob("*.ptx") if p.read_text() == a]
    path.write_text(a + "// cached\n")
    assert cbuild.compile_ptx(src, defines={"VALUE": 1}, arch="compute_90").endswith("cached\n")


def test_launch_probe_runs_eagerly_inside_a_trace(monkeypatch):
    """The once-per-process launch probe is usually first reached while a jitted model is being
    traced; it must still run eagerly (concrete values), not be staged into that trace, or it
    would fail and wrongly fall back to buffer_callback."""
    seen = []

    def probe(call):
        seen.append(float(jnp.ones((), jnp.float32) * 2))  # needs a concrete value

    monkeypatch.delenv(_dispatch.LAUNCH_ENV, raising=False)
    monkeypatch.setattr(_dispatch, "on_cuda", lambda: True)
    monkeypatch.setattr(nvfp4_gemv, "probe_ptx_launch", probe)
    _dispatch.default_launch.cache_clear()
    try:
        w = nvfp4.quantize_weight(jnp.ones((64, 256), jnp.bfloat16))
        jax.jit(lambda x: kernels.nvfp4_linear(x, w, act="w4a16"))(jnp.ones((1, 256), jnp.bfloat16))
        assert seen == [2.0]
        assert _dispatch.default_launch() == "ptx"
    finally:
        _dispatch.default_launch.cache_clear()
